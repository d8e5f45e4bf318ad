"""The K schedule as vLLM takes it: batch-size ranges, at start-up and at run time.

Runs in the rollout service process; pure but for :func:`with_startup_schedule`, which
resolves the engine's config with vLLM (imported there, not at module level).

vLLM 0.32.0's scheduler, in the engine-core process, reads the number of draft tokens K
of every step from a dense batch size -> K lookup built from
``speculative_config.num_speculative_tokens_per_batch_size``: a list of inclusive ranges
``[start, end, K]`` whose first starts at 1; gaps and the tail past the last range carry
the previous K forward (``vllm/v1/spec_decode/dynamic/utils.py``). The service's schedule
is a table ``{bucket upper edge: K}`` (the speculation controller's ``schedule()``); this
module converts it, and builds the schedule the engine starts with. The engine-core side
that swaps the lookup at run time is ``patches/spec_schedule.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from rollout_service.engines.base import FullGraphPolicy
from rollout_service.engines.vllm.capture_ceiling import with_controlled_ceiling
from rollout_service.engines.vllm.graph_ladder import query_lens_of
from rollout_service.engines.vllm.graph_policy import (
    apply_full_graph_policy,
    can_diverge,
    check_cuda_graphs,
    resolve,
)

if TYPE_CHECKING:
    from vllm.engine.arg_utils import AsyncEngineArgs

ScheduleRanges = list[list[int]]
"""vLLM's ``num_speculative_tokens_per_batch_size``: ``[[start, end, K], ...]``, inclusive."""


def check_schedule(schedule: Mapping[int, int]) -> None:
    """Refuse a table that is not ``{batch size >= 1: K >= 0}`` with integer keys and values.

    Raises:
        ValueError: naming the entry at fault.
    """
    if not schedule:
        raise ValueError("schedule: empty (it needs at least one batch size -> K entry)")
    for edge, k in schedule.items():
        if not _is_int(edge) or edge < 1:
            raise ValueError(f"schedule: batch size {edge!r} must be an integer >= 1")
        if not _is_int(k) or k < 0:
            raise ValueError(f"schedule: K {k!r} at batch size {edge} must be an integer >= 0")


def schedule_to_ranges(schedule: Mapping[int, int]) -> ScheduleRanges:
    """``{upper edge: K}`` -> vLLM's ranges: ``[[1, e1, K1], [e1 + 1, e2, K2], ...]``.

    Edge ``e_j`` covers the batch sizes ``(e_{j-1}, e_j]``; batch sizes past the last edge
    keep the last K (vLLM carries it through the tail), exactly as the controller's
    ``k_for`` reads its own table (``speculation.controller.k_at``). Adjacent buckets with
    the same K merge into one range.

    Raises:
        ValueError: see :func:`check_schedule`.
    """
    check_schedule(schedule)
    ranges: ScheduleRanges = []
    start = 1
    for edge in sorted(schedule):
        k = schedule[edge]
        if ranges and ranges[-1][2] == k:
            ranges[-1][1] = edge
        else:
            ranges.append([start, edge, k])
        start = edge + 1
    return ranges


def lookup_to_schedule(lookup: Sequence[int]) -> dict[int, int]:
    """vLLM's dense lookup (``lookup[i]``: K at batch size ``i + 1``) -> the smallest table
    that gives the same K at every batch size."""
    schedule: dict[int, int] = {}
    for batch_size, k in enumerate(lookup, start=1):
        if batch_size < len(lookup) and lookup[batch_size] == k:
            continue  # the run goes on
        schedule[batch_size] = k
    return schedule


def startup_ranges(k_max: int, max_batch_size: int) -> ScheduleRanges:
    """The schedule the engine starts with: every K in ``0..k_max`` at some batch size,
    rising with the batch size, ``k_max`` from the last tier up to ``max_batch_size``.

    Why every K: vLLM's model runner V2 captures CUDA graphs at start-up for the K values
    of the start-up schedule only, the target's FULL decode graphs for query length K + 1
    (``vllm/v1/worker/gpu/cudagraph_utils.py``) and the drafter's fused graphs per K
    (``vllm/v1/worker/gpu/spec_decode/target_dependent_ar/cudagraph_utils.py``); a K
    missing at start-up runs without graphs for good. Why ``k_max`` on the widest tier:
    the capture sizes are the union of every tier's request counts times its query length
    (``vllm/config/vllm.py``, dynamic speculative decoding), each rounded up to a multiple
    of every query length; the widest tier at the longest query length reaches the capture
    ceiling in tokens, so every K gets FULL graphs up to about ``ceiling / (K + 1)``
    requests. The schedule is in force only until the service applies the controller's,
    before any request.

    Tier edges are geometric in the batch size (``max_batch_size ** (i / (k_max + 1))``),
    at least one batch size each.

    Raises:
        ValueError: ``k_max < 1`` or ``max_batch_size <= k_max`` (no room for every K).
    """
    if k_max < 1 or max_batch_size <= k_max:
        raise ValueError(f"need k_max >= 1 and max_batch_size > k_max to give every K a "
                         f"batch size, got k_max={k_max}, max_batch_size={max_batch_size}")
    ranges: ScheduleRanges = []
    start = 1
    for k in range(k_max):
        geometric = round(max_batch_size ** ((k + 1) / (k_max + 1)))
        end = min(max(geometric, start), max_batch_size - (k_max - k))
        ranges.append([start, end, k])
        start = end + 1
    ranges.append([start, max_batch_size, k_max])
    return ranges


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def with_startup_schedule(args: AsyncEngineArgs, *,
                          full_cuda_graphs: FullGraphPolicy = "align") -> AsyncEngineArgs:
    """``args`` with the K schedule a run-time schedule needs at start-up: every K in
    ``0..num_speculative_tokens`` at some batch size (:func:`startup_ranges`), over the
    batch sizes vLLM will allow (its ``max_num_seqs``, resolved here as vLLM resolves it
    for the service: ``usage_context.py``), and per-request metrics with each step's
    counts (``detailed``). On CUDA, graphs captured up to ``k_max + 1`` times vLLM's
    default ceiling unless the user chose the capture (``capture_ceiling.py``; not under
    ``as_is``), and FULL CUDA graphs as ``full_cuda_graphs`` says (``graph_policy.py``:
    refused, aligned capture sizes, or vLLM's own).

    Raises:
        ValueError: naming the field: no speculative decoding, a schedule of the user's
            own, data parallelism (vLLM drops any schedule there), vLLM's model runner V1
            on CUDA (it forces PIECEWISE graphs with a schedule, vllm-project/vllm#49548),
            FULL CUDA graphs under ``refuse`` (``graph_policy.check_cuda_graphs``),
            or a vLLM version the engine-core patch does not support.
    """
    from vllm import __version__ as vllm_version
    from vllm.platforms import current_platform

    from rollout_service.engines.vllm.patches import spec_schedule as schedule_rpc

    field = "speculation_control.enabled"
    speculative = args.speculative_config
    if vllm_version not in schedule_rpc.SUPPORTED_VLLM_VERSIONS:
        raise ValueError(f"{field}: the run-time K schedule supports vLLM "
                         f"{schedule_rpc.SUPPORTED_VLLM_VERSIONS}, not {vllm_version}")
    if not speculative:
        raise ValueError(f"{field}: needs speculative decoding (mtp.enabled or "
                         "engine_kwargs.speculative_config)")
    if speculative.get("num_speculative_tokens_per_batch_size") is not None:
        raise ValueError("engine_kwargs.speculative_config.num_speculative_tokens_per_batch_"
                         f"size: the speculation control sets it ({field}); leave it out")
    if (args.data_parallel_size or 1) > 1:
        raise ValueError(f"{field}: vLLM drops a K schedule with data parallelism "
                         f"(engine_kwargs.data_parallel_size={args.data_parallel_size})")
    config = resolve(args)
    if current_platform.is_cuda() and not config.use_v2_model_runner:
        raise ValueError(f"{field}: vLLM's model runner V1 on CUDA turns a K schedule's "
                         "FULL CUDA graphs into PIECEWISE ones (vllm-project/vllm#49548); "
                         "run model runner V2 (VLLM_USE_V2_MODEL_RUNNER=1)")
    mode, is_cuda = config.compilation_config.cudagraph_mode, current_platform.is_cuda()
    check_cuda_graphs(mode, is_cuda=is_cuda, policy=full_cuda_graphs)
    ranges = startup_ranges(config.speculative_config.num_speculative_tokens,
                            config.scheduler_config.max_num_seqs)
    # Each step's proposed and accepted counts: vLLM's histogram alone cannot tell the K
    # of a step, and the controller's acceptance per position needs it
    # (speculation/acceptance.py). The service's default level is "summary".
    metrics = ("detailed" if args.per_request_spec_decode_metrics == "summary"
               else args.per_request_spec_decode_metrics)
    startup = dataclasses.replace(args, per_request_spec_decode_metrics=metrics,
                                  speculative_config={
                                      **speculative,
                                      "num_speculative_tokens_per_batch_size": ranges})
    if is_cuda and full_cuda_graphs != "as_is":  # as_is: vLLM's graphs as vLLM makes them
        startup = with_controlled_ceiling(startup, config)
    if not (is_cuda and can_diverge(mode)):
        return startup
    return apply_full_graph_policy(startup, resolve(startup), policy=full_cuda_graphs,
                                   query_lens=query_lens_of(ranges))
