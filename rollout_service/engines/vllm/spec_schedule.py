"""The K schedule as vLLM takes it: batch-size ranges, at start-up and at run time.

Runs in the rollout service process; pure (no vLLM import). vLLM 0.32.0's scheduler, in
the engine-core process, reads the number of draft tokens K of every step from a dense
batch size -> K lookup built from ``speculative_config.num_speculative_tokens_per_batch_size``:
a list of inclusive ranges ``[start, end, K]`` whose first starts at 1; gaps and the tail
past the last range carry the previous K forward (``vllm/v1/spec_decode/dynamic/utils.py``).
The service's schedule is a table ``{bucket upper edge: K}`` (the speculation controller's
``schedule()``); this module converts it, and builds the schedule the engine starts with.
The engine-core side that swaps the lookup at run time is ``patches/spec_schedule.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

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

