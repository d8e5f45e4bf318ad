"""Trainer-side code that builds on megatron-core."""
