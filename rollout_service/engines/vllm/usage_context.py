"""Which of vLLM's batch-size defaults the service's engine takes: the API server's.

vLLM resolves ``max_num_seqs`` and ``max_num_batched_tokens``, when the user leaves them
out, from the *usage context* of whoever starts the engine
(``EngineArgs.get_batch_defaults`` in ``vllm/engine/arg_utils.py``). ``vllm serve`` starts
it as ``OPENAI_API_SERVER``; ``AsyncLLM.from_engine_args`` defaults to
``ENGINE_CONTEXT``, which has no entry and falls back to the scheduler's own defaults.
On an H200 that is 1024 sequences and 8192 batched tokens for the API server against 128
and 2048 for an embedded engine; on the CPU both resolve to 128 and 2048.

The rollout service serves HTTP the way ``vllm serve`` does, so it takes the API
server's defaults. Measured on the H200 before this (``docs/benchmarks.md``): at 512
concurrent requests the service's engine ran 128 of them at a time and reached 0.82x
``vllm serve``, while it matched ``vllm serve`` at 128. Any value the user sets in
``engine_kwargs`` still wins.

Every place that resolves the engine's config before it starts (the start-up K schedule
reads ``max_num_seqs``) must pass the same context, or it sizes for another engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.usage.usage_lib import UsageContext


def serving_usage_context() -> UsageContext:
    """The usage context the service starts vLLM with (and resolves its config with)."""
    from vllm.usage.usage_lib import UsageContext

    return UsageContext.OPENAI_API_SERVER
