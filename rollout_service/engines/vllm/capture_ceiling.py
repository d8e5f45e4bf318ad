"""The CUDA graph capture ceiling of an engine whose K the speculation controller changes.

Runs in the rollout service process at start-up, from
:func:`~rollout_service.engines.vllm.spec_schedule.with_startup_schedule`, before the
capture sizes are aligned (``graph_policy.py``).

vLLM 0.32.0 captures CUDA graphs up to a ceiling in tokens a step: 512 by default (1024
on compute capability 10.x), whatever K runs (``vllm/config/vllm.py``,
``_set_cudagraph_sizes``). A step above it runs without a graph. Without speculation that
is 512 requests; at K = 3 each request is 4 tokens, so the graphs end at 128 requests.
On one H100 (embedded 1B, draft noise 0.1, ``bench.speculation`` at c = 256) pinned
K = 2 and 3 ran at 0.50-0.59 of pinned K = 0 with that ceiling (K = 2's step cost jumped
from 7.32 ms at 170 requests to 19.32 ms at 198, past it); with a ceiling of 2048 tokens
pinned K = 3 ran at 1.34x K = 0 at the same concurrency (docs/speculation-control.md,
Benchmark). So a controller on vLLM's ceiling can only choose K = 0 or 1 where a rollout
starts, however good its drafter.

The service therefore raises the ceiling to ``(k_max + 1)`` times vLLM's default: every K
then has graphs up to as many requests as vLLM gives a step without speculation (the
request-count coverage vLLM's own comment in ``_set_cudagraph_sizes`` aims at). The price
is start-up time and graph memory (on that H100 the speculating 1B engine's capture took
36 s and 4.5 GiB at 2048 tokens). A ceiling or capture sizes of the user's own are kept;
``engine_kwargs.compilation_config.max_cudagraph_capture_size: 512`` restores vLLM's.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

logger = logging.getLogger(__name__)


def vllm_default_ceiling(*, is_blackwell: bool) -> int:
    """vLLM 0.32.0's default capture ceiling in tokens a step (``_set_cudagraph_sizes``)."""
    return 1024 if is_blackwell else 512


def controlled_ceiling(k_max: int, *, is_blackwell: bool, max_num_batched_tokens: int) -> int:
    """The ceiling for an engine whose K runs ``0..k_max``: vLLM's default times the
    longest query length ``k_max + 1``, within the step's token budget (a graph above it
    would never run)."""
    return min((k_max + 1) * vllm_default_ceiling(is_blackwell=is_blackwell),
               max_num_batched_tokens)


def sets_capture(args: AsyncEngineArgs) -> bool:
    """Whether ``args`` name a capture ceiling or capture sizes, at the top level or in
    ``compilation_config``."""
    compilation = args.compilation_config
    return any(value is not None for value in (
        args.max_cudagraph_capture_size, args.cudagraph_capture_sizes,
        compilation.max_cudagraph_capture_size, compilation.cudagraph_capture_sizes))


def with_controlled_ceiling(args: AsyncEngineArgs, config: VllmConfig) -> AsyncEngineArgs:
    """``args`` capturing up to :func:`controlled_ceiling` tokens (``config``: vLLM's
    resolution of ``args``); unchanged where the user set the capture, or where the
    engine captures no graph (eager, ``cudagraph_mode: NONE``)."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.platforms import current_platform

    if sets_capture(args) or config.model_config.enforce_eager or (
            config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE):
        return args
    ceiling = controlled_ceiling(
        config.speculative_config.num_speculative_tokens,
        is_blackwell=current_platform.is_device_capability_family(100),
        max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens)
    was = config.compilation_config.max_cudagraph_capture_size
    if was is not None and ceiling <= was:
        return args
    compilation = copy.deepcopy(args.compilation_config)
    compilation.max_cudagraph_capture_size = ceiling
    logger.info("speculation control: CUDA graphs captured up to %d tokens a step (vLLM's "
                "default here: %s), so that every K up to %d has graphs up to as many "
                "requests as a step without speculation; set engine_kwargs."
                "compilation_config.max_cudagraph_capture_size to choose", ceiling, was,
                config.speculative_config.num_speculative_tokens)
    return dataclasses.replace(args, compilation_config=compilation)
