"""Trainer-side companion of the rollout service: weight pushes (and, later, the
Megatron MTP loss, padding and weight export)."""
