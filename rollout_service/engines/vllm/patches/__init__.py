"""Fixes of vLLM bugs, each its own ``vllm.general_plugins`` entry point (see README.md)."""
