"""MTP-aware RL rollout service: engines, telemetry and weight sync behind one HTTP API."""
