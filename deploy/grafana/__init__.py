"""Grafana dashboards of the rollout service, generated from Python (see ``dashboards``)."""
