"""vLLM's rollout dialect (``api/dialects``): protocol, serving, router."""
