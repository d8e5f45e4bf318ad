"""SGLang's rollout dialect (``api/dialects``): protocol, serving, router."""
