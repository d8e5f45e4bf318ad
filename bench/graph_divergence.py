"""Where the MTP drafter replays another CUDA graph than its target: a table per K schedule
and capture sizes, from the model that ``test_vllm_graph_ladder.py`` checks against
vLLM 0.32.0's own dispatch (``rollout_service/engines/vllm/graph_ladder.py``).

Runs on any machine, no engine: the capture sizes are those vLLM 0.32.0 computes by
default on an H100/H200 (its grid up to 512 tokens plus each tier's request-count grid
times its query length, as ``vllm/config/vllm.py`` does; an H200 engine started with
``full_cuda_graphs: as_is`` logs the batch sizes at risk for its own), or ``--sizes``.
Each row: the batch sizes at which the drafter's prefill replays a FULL graph captured for
more requests than the target ran, per K, with vLLM's sizes and with the service's
aligned ones (``full_cuda_graphs: align``): for the controller's engine every K at every
batch size (a run-time schedule reaches them all), for a static schedule the K it runs.

    python -m bench.graph_divergence --k-max 3 --max-num-seqs 1024
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from rollout_service.engines.vllm.graph_ladder import (
    GraphLadder,
    aligned_capture_sizes,
    divergent_batches,
    query_lens_of,
)
from rollout_service.engines.vllm.graph_policy import query_len_per_batch_size
from rollout_service.engines.vllm.spec_schedule import ScheduleRanges, startup_ranges

DEFAULT_GRID = (1, 2, 4, *range(8, 256, 8), *range(256, 513, 16))
"""vLLM's default capture sizes up to its 512-token ceiling (``vllm/config/vllm.py``)."""


def request_counts(max_reqs: int) -> list[int]:
    """vLLM's request-count grid for a decode tier (``vllm/config/vllm.py``)."""
    max_reqs = min(max_reqs, 512)
    counts = [n for n in (1, 2, 4) if n <= max_reqs]
    counts += [*range(8, min(max_reqs + 1, 256), 8), *range(256, max_reqs + 1, 16)]
    return sorted({*counts, max_reqs})


def default_sizes(schedule: ScheduleRanges, max_num_seqs: int) -> list[int]:
    """vLLM 0.32.0's default capture sizes on an H100/H200 with ``schedule``:
    :data:`DEFAULT_GRID` plus each tier's request counts times its query length, up to
    512 tokens (``vllm/config/vllm.py``; the tier of a query length ends at the widest
    batch size running it)."""
    widest: dict[int, int] = {}
    for _, end, k in sorted(schedule):
        widest[k + 1] = min(end, max_num_seqs)
    tiers = {n * q for q, end in widest.items() for n in request_counts(end) if n * q <= 512}
    return sorted(set(DEFAULT_GRID) | tiers)


def ladder(sizes: list[int], schedule: ScheduleRanges, max_num_seqs: int, *,
           has_piecewise: bool = True) -> GraphLadder:
    """The graphs of ``sizes`` for every query length ``schedule`` holds."""
    return GraphLadder(capture_sizes=tuple(sizes),
                       query_lens=query_lens_of(schedule),
                       max_num_reqs=max_num_seqs, max_capture_size=max(sizes),
                       has_piecewise=has_piecewise)


def describe(sizes: list[int], schedule: ScheduleRanges, max_num_seqs: int,
             where_run: list[int] | None) -> str:
    found = divergent_batches(ladder(sizes, schedule, max_num_seqs), where_run)
    parts = []
    for q in sorted({d.query_len for d in found}):
        batches = [d.num_reqs for d in found if d.query_len == q]
        shown = ", ".join(map(str, batches[:8])) + (", ..." if len(batches) > 8 else "")
        parts.append(f"K={q - 1}: {len(batches)} ({shown})")
    return "; ".join(parts) or "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k-max", type=int, default=3)
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--schedules", default=None,
                        help="JSON list of extra static schedules, e.g. '[[[1,16,3],[17,1024,0]]]'")
    parser.add_argument("--sizes", default=None, help="comma-separated capture sizes "
                        "(default: vLLM's grid plus the tiers' decode sizes)")
    opts = parser.parse_args()
    schedules = {"start-up (the controller's engine)": startup_ranges(opts.k_max,
                                                                      opts.max_num_seqs)}
    for extra in json.loads(opts.schedules or "[]"):
        schedules[json.dumps(extra)] = extra
    table = Table(title=f"drafter/target divergence, k_max {opts.k_max}, "
                        f"max_num_seqs {opts.max_num_seqs}")
    for column in ("schedule", "sizes", "divergent batch sizes per K"):
        table.add_column(column)
    for i, (name, schedule) in enumerate(schedules.items()):
        sizes = ([int(s) for s in opts.sizes.split(",")] if opts.sizes
                 else default_sizes(schedule, opts.max_num_seqs))
        # The controller's engine reaches every K at every batch size; a static one, its own.
        where_run = None if i == 0 else query_len_per_batch_size(
            schedule, max_num_seqs=opts.max_num_seqs, k_max=opts.k_max)
        aligned = aligned_capture_sizes(sizes, query_lens_of(schedule),
                                        max_num_tokens=opts.max_num_batched_tokens)
        table.add_row(name, f"vLLM's: {len(sizes)} up to {max(sizes)}",
                      describe(sizes, schedule, opts.max_num_seqs, where_run))
        table.add_row("", f"aligned: {len(aligned)} up to {max(aligned)}",
                      describe(aligned, schedule, opts.max_num_seqs, where_run))
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
