"""What the speculation controller does with a CUDA engine's FULL CUDA graphs:
refuse them, align their capture sizes, or take them as vLLM made them.

Runs in the rollout service process at start-up, from
:func:`~rollout_service.engines.vllm.spec_schedule.with_startup_schedule`.

vLLM 0.32.0's engine died of ``CUDA error: an illegal memory access`` inside a replayed
graph when K changed under load on an H200 with its default graphs
(docs/speculation-control.md, "The crash on the H200"); eager, the same load ran clean.
``graph_ladder.py`` gives the mechanism: at some batch sizes the MTP drafter's prefill
replays a FULL graph captured for more requests than the target ran. On the H200, vLLM
alone failed at such a batch and served the batch beside it
(``test_vllm_graph_divergence.py``; how it failed was not recorded). ``align`` (the
default) rounds the capture sizes so that no batch size does, and checks it; with it,
1000 random K changes under 256 requests ran clean there, twice (``test_spec_churn.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from typing import TYPE_CHECKING

from rollout_service.engines.base import FullGraphPolicy
from rollout_service.engines.vllm.graph_ladder import (
    GraphLadder,
    aligned_capture_sizes,
    divergent_batches,
    query_lens_of,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.compilation import CUDAGraphMode
    from vllm.engine.arg_utils import AsyncEngineArgs

logger = logging.getLogger(__name__)

FIELD = "speculation_control.full_cuda_graphs"

MAX_ALIGNMENT = 60
"""The largest multiple ``align`` rounds to: query lengths 1..5 (``k_max`` 4 or 5). Above
it (420 for ``k_max`` 6) a one-request decode would pad to hundreds of tokens."""


def check_cuda_graphs(cudagraph_mode: CUDAGraphMode, *, is_cuda: bool,
                      policy: FullGraphPolicy) -> None:
    """Refuse a run-time schedule on CUDA with FULL CUDA graphs under ``refuse``: a
    speculating engine the controller drives must not die mid-rollout.

    Raises:
        ValueError: naming ``speculation_control.full_cuda_graphs`` and the ways out.
    """
    if is_cuda and cudagraph_mode.has_full_cudagraphs() and policy == "refuse":
        raise ValueError(
            f"{FIELD}: this engine's CUDA graphs ({cudagraph_mode.name}) include FULL ones, "
            "with which vLLM 0.32.0 has died of an illegal memory access when the "
            "controller changed K under load (docs/speculation-control.md, the crash on "
            "the H200). Set engine_kwargs.enforce_eager: true (ran clean), or "
            "engine_kwargs.compilation_config.cudagraph_mode: PIECEWISE (no FULL graphs; "
            f"not yet run under changes), or {FIELD}: align (the default: capture sizes with "
            "which the drafter replays the target's graph), or as_is to accept "
            "the risk (with cudagraph_mode: FULL_DECODE_ONLY the drafter cannot diverge)")


def can_diverge(cudagraph_mode: CUDAGraphMode) -> bool:
    """Only FULL_AND_PIECEWISE graphs can diverge (FULL, FULL_DECODE_ONLY and PIECEWISE
    cannot: ``test_vllm_graph_ladder.py`` checks it on vLLM's own dispatch)."""
    from vllm.config.compilation import CUDAGraphMode

    return cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE


def apply_full_graph_policy(args: AsyncEngineArgs, config: VllmConfig, *,
                            policy: FullGraphPolicy, query_lens: tuple[int, ...],
                            query_len_at: list[int] | None = None) -> AsyncEngineArgs:
    """``args`` (with a K schedule; ``config``: vLLM's resolution of them, on CUDA) as
    ``policy`` starts them: ``align``: aligned capture sizes (:func:`align_full_graphs`);
    otherwise unchanged, with a warning naming the batch sizes at which the drafter will
    replay another graph than the target (:func:`warn_divergence`; ``query_len_at``: a
    static schedule's, to name only the batches it runs). Graphs that cannot diverge:
    ``args`` unchanged."""
    if not can_diverge(config.compilation_config.cudagraph_mode):
        return args
    if policy == "align":
        return align_full_graphs(args, query_lens, config)
    warn_divergence(config, query_lens, query_len_at)
    return args


def with_user_schedule_graphs(args: AsyncEngineArgs,
                              policy: FullGraphPolicy) -> AsyncEngineArgs:
    """``args`` for a K schedule of the user's own (``engine_kwargs.speculative_config.
    num_speculative_tokens_per_batch_size``, the controller off; a bench's static one),
    which vLLM runs on the same graphs: aligned under ``align``; under ``refuse`` and
    ``as_is`` unchanged, with the warning (the user chose that schedule; vLLM may serve it
    clean on another GPU or version). No schedule, or no CUDA: ``args`` unchanged."""
    from vllm.platforms import current_platform

    schedule = (args.speculative_config or {}).get("num_speculative_tokens_per_batch_size")
    if not schedule or not current_platform.is_cuda():
        return args
    config = resolve(args)
    return apply_full_graph_policy(
        args, config, policy="align" if policy == "align" else "as_is",
        query_lens=query_lens_of(schedule),
        query_len_at=query_len_per_batch_size(
            schedule, max_num_seqs=config.scheduler_config.max_num_seqs,
            k_max=config.speculative_config.num_speculative_tokens))


def query_len_per_batch_size(schedule: list[list[int]], *, max_num_seqs: int,
                             k_max: int) -> list[int]:
    """The query length K + 1 a static ``schedule`` runs at each batch size (index), from
    vLLM's own dense lookup."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    return [k + 1 for k in build_dynamic_sd_schedule_lookup(
        schedule, vllm_max_batch_size=max_num_seqs, vllm_num_speculative_tokens=k_max)]


def resolve(args: AsyncEngineArgs) -> VllmConfig:
    """The config vLLM will run ``args`` with (resolved as for the service)."""
    from rollout_service.engines.vllm.usage_context import serving_usage_context

    return dataclasses.replace(args).create_engine_config(serving_usage_context())


def warn_divergence(config: VllmConfig, query_lens: tuple[int, ...],
                    query_len_at: list[int] | None = None) -> None:
    """Log where ``config``'s drafter replays another graph than its target (``as_is``, and
    a user's own schedule under ``refuse``: only the batches it runs, ``query_len_at``)."""
    found = divergent_batches(ladder_of(config, query_lens), query_len_at)
    for q in query_lens:
        sizes = [d.num_reqs for d in found if d.query_len == q]
        if sizes:
            logger.warning("%s: at K = %d the drafter replays a FULL CUDA graph of more "
                           "requests than the target ran at %d batch sizes: %s%s (vLLM "
                           "0.32.0 died at such batches on an H200; align avoids them)",
                           FIELD, q - 1, len(sizes), sizes[:16],
                           " ..." if len(sizes) > 16 else "")


def ladder_of(config: VllmConfig, query_lens: tuple[int, ...]) -> GraphLadder:
    """The graphs ``config`` (resolved by vLLM) captures for uniform decodes."""
    from vllm.config.compilation import CUDAGraphMode

    compilation = config.compilation_config
    return GraphLadder(
        capture_sizes=tuple(compilation.cudagraph_capture_sizes or ()), query_lens=query_lens,
        max_num_reqs=config.scheduler_config.max_num_seqs,
        max_capture_size=compilation.max_cudagraph_capture_size or 0,
        has_piecewise=compilation.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE)


def with_capture_sizes(args: AsyncEngineArgs, sizes: list[int]) -> AsyncEngineArgs:
    """``args`` capturing exactly ``sizes`` (through ``compilation_config``; the
    top-level shortcuts vLLM would refuse beside it are cleared)."""
    compilation = copy.deepcopy(args.compilation_config)
    compilation.cudagraph_capture_sizes = sizes
    compilation.max_cudagraph_capture_size = max(sizes)
    return dataclasses.replace(args, compilation_config=compilation,
                               cudagraph_capture_sizes=None, max_cudagraph_capture_size=None)


def check_no_divergence(ladder: GraphLadder) -> None:
    """Raises:
        ValueError: naming the field and the first batches whose drafter would replay a
            FULL graph of more requests than its target ran.
    """
    found = divergent_batches(ladder)
    if found:
        shown = ", ".join(f"{d.num_reqs} requests at query length {d.query_len}"
                          for d in found[:4])
        raise ValueError(
            f"{FIELD}: with {len(ladder.capture_sizes)} CUDA graph capture sizes up to "
            f"{max(ladder.capture_sizes)} tokens the drafter replays "
            f"another CUDA graph than the target at {len(found)} batch sizes ({shown}); "
            "leave engine_kwargs.compilation_config.cudagraph_capture_sizes to the service")


def align_full_graphs(args: AsyncEngineArgs, query_lens: tuple[int, ...],
                      config: VllmConfig | None = None) -> AsyncEngineArgs:
    """``args`` whose capture sizes (vLLM's own, or the user's) are rounded to multiples of
    every query length, checked on the config vLLM resolves from them (``config``: vLLM's
    resolution of ``args`` where the caller has it; None: resolved here).

    Raises:
        ValueError: naming the field: the multiple is above :data:`MAX_ALIGNMENT` (a decode
            of one request would pad to it), or a divergence is left (see
            :func:`check_no_divergence`).
    """
    step = math.lcm(*query_lens)
    if step > MAX_ALIGNMENT:
        raise ValueError(
            f"{FIELD}: align would round the capture sizes to multiples of {step} (every "
            f"query length K + 1 up to {max(query_lens)}), padding small batches to {step} "
            "tokens; set engine_kwargs.compilation_config.cudagraph_mode: FULL_DECODE_ONLY "
            "(its drafter cannot diverge) with full_cuda_graphs: as_is, or a smaller "
            "num_speculative_tokens")
    before = config or resolve(args)
    sizes = aligned_capture_sizes(
        before.compilation_config.cudagraph_capture_sizes or [1], query_lens,
        max_num_tokens=before.scheduler_config.max_num_batched_tokens)
    aligned = with_capture_sizes(args, sizes)
    check_no_divergence(ladder_of(resolve(aligned), query_lens))
    logger.info("CUDA graph capture sizes aligned for the speculation control: %d sizes, "
                "multiples of %d up to %d tokens (were %d sizes up to %d)", len(sizes),
                step, sizes[-1],
                len(before.compilation_config.cudagraph_capture_sizes or ()),
                before.compilation_config.max_cudagraph_capture_size)
    return aligned
