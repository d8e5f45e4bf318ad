"""Which CUDA graph a uniform decode step replays, in the target and in the drafter, and
the capture sizes with which the two always agree.

Runs in the rollout service process, at start-up; pure (no vLLM import).

Why: with a K schedule, vLLM 0.32.0's model runner V2 captures FULL uniform-decode graphs
for every query length ``q = K + 1`` the start-up schedule holds, at each capture size
rounded up to a multiple of ``q`` (``vllm/v1/worker/gpu/cudagraph_utils.py``,
``CudaGraphManager._init_candidates``). A batch of ``r`` requests at query length ``q``
(``r * q`` tokens) looks for its FULL graph at the *nearest* FULL size at or above
``r * q`` only; when that size holds graphs of other query lengths alone, the target runs
PIECEWISE, padded to the nearest capture size ``P``, with attention metadata built for
its ``r`` requests. The MTP drafter's prefill then dispatches again on ``P`` tokens
(``vllm/v1/worker/gpu/spec_decode/target_dependent_ar/speculator.py``) and can find a
FULL graph for ``q`` there, captured for ``P / q > r`` requests, which it replays on the
target's metadata. A FULL graph replayed on metadata for fewer requests than it was
captured for reads what no step wrote (FA3's scheduler metadata past ``r``): our
hypothesis for the illegal memory access of docs/speculation-control.md, not yet confirmed
on a GPU (the docs list the runs it fits and its gaps); the same shadowing is
vllm-project/vllm#56136 (open), and
vllm-project/vllm#53660 (open) describes the drafter reusing the target's metadata.

:func:`divergent_batches` finds those batches; :func:`aligned_capture_sizes` removes them
by making every capture size a multiple of every query length, so that each FULL size
holds a graph for each query length and the target never falls to PIECEWISE below the
largest size. ``tests/unit/rollout_service/test_vllm_graph_ladder.py`` checks this model
against vLLM's own ``CudaGraphManager`` (``dispatch`` on its real candidates), so a vLLM
whose rules differ fails there, not in an engine.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

GraphMode = Literal["FULL", "PIECEWISE", "NONE"]


@dataclass(frozen=True)
class GraphChoice:
    """The graph one forward pass replays: mode, padded tokens, and for a FULL graph the
    requests it was captured for (None: PIECEWISE and eager take any number)."""

    mode: GraphMode
    num_tokens: int
    num_reqs: int | None = None


@dataclass(frozen=True)
class GraphLadder:
    """vLLM 0.32.0's candidate graphs for uniform decodes (no LoRA, no micro-batching, no
    variable-length decode graphs: what the service's MTP engines run).

    Attributes:
        capture_sizes: ``compilation_config.cudagraph_capture_sizes`` as resolved.
        query_lens: the query lengths ``K + 1`` of the start-up schedule.
        max_num_reqs: ``scheduler_config.max_num_seqs``.
        max_capture_size: ``compilation_config.max_cudagraph_capture_size``.
        has_piecewise: mixed batches have PIECEWISE graphs (FULL_AND_PIECEWISE); False for
            FULL_DECODE_ONLY, whose other batches run eager.
    """

    capture_sizes: tuple[int, ...]
    query_lens: tuple[int, ...]
    max_num_reqs: int
    max_capture_size: int
    has_piecewise: bool = True

    @cached_property
    def full_graphs(self) -> dict[int, dict[int, int]]:
        """FULL size in tokens -> {query length: requests captured}."""
        levels: dict[int, dict[int, int]] = {}
        for size in self.capture_sizes:
            for q in self.query_lens:
                tokens = math.ceil(size / q) * q
                reqs = tokens // q
                # vLLM also skips tokens above max_num_reqs * (k_max + 1): implied here,
                # as no query length exceeds k_max + 1.
                if tokens > self.max_capture_size or reqs > self.max_num_reqs:
                    continue
                levels.setdefault(tokens, {})[q] = reqs
        return levels

    def dispatch(self, num_reqs: int, num_tokens: int, query_len: int) -> GraphChoice:
        """The graph a uniform decode of ``num_reqs`` requests, ``num_tokens`` tokens (the
        target's own, or the padded count the drafter's prefill passes) replays:
        the nearest FULL size at or above ``num_tokens`` if it holds this query length for
        enough requests, else the nearest PIECEWISE size, else eager (vLLM's
        ``CudaGraphManager.dispatch`` over ``_init_candidates``)."""
        full_sizes = self._full_sizes
        i = bisect.bisect_left(full_sizes, num_tokens)
        if i < len(full_sizes):
            # A size at or above num_reqs * query_len tokens holds enough requests.
            reqs = self.full_graphs[full_sizes[i]].get(query_len)
            if reqs is not None:
                return GraphChoice("FULL", full_sizes[i], reqs)
        if self.has_piecewise:
            sizes = self._piecewise_sizes
            j = bisect.bisect_left(sizes, num_tokens)
            if j < len(sizes):
                return GraphChoice("PIECEWISE", sizes[j])
        return GraphChoice("NONE", num_tokens)

    @cached_property
    def _full_sizes(self) -> list[int]:
        return sorted(self.full_graphs)

    @cached_property
    def _piecewise_sizes(self) -> list[int]:
        return sorted(self.capture_sizes)


@dataclass(frozen=True)
class Divergence:
    """A uniform decode whose drafter replays another graph than its target: a FULL graph
    captured for ``drafter.num_reqs`` requests on metadata built for ``num_reqs``."""

    query_len: int
    num_reqs: int
    target: GraphChoice
    drafter: GraphChoice


def query_lens_of(schedule: Iterable[Sequence[int]]) -> tuple[int, ...]:
    """The query lengths K + 1 a K schedule (``[first, last, K]`` ranges, vLLM's
    ``num_speculative_tokens_per_batch_size``) captures graphs for, ascending."""
    return tuple(sorted({k + 1 for *_, k in schedule}))


def divergent_batches(ladder: GraphLadder,
                      query_len_at: Sequence[int] | None = None) -> list[Divergence]:
    """Every (query length, batch size) at which the drafter's prefill replays another graph
    than the target did, in order.

    Args:
        query_len_at: a static schedule's query length per batch size (index: the batch
            size; vLLM's dense lookup plus 1): only the batches it runs. None: every query
            length at every batch size, which a run-time schedule can reach.
    """
    found = []
    for q in ladder.query_lens:
        for r in range(1, ladder.max_num_reqs + 1):
            if query_len_at is not None and query_len_at[r] != q:
                continue
            target = ladder.dispatch(r, r * q, q)
            drafter = ladder.dispatch(r, max(r * q, target.num_tokens), q)
            if drafter != target:
                found.append(Divergence(q, r, target, drafter))
    return found


def aligned_capture_sizes(capture_sizes: Iterable[int], query_lens: Sequence[int], *,
                          max_num_tokens: int) -> list[int]:
    """``capture_sizes`` each rounded up to a multiple of every query length (their least
    common multiple), down where rounding up would pass ``max_num_tokens`` (vLLM drops
    sizes above it): each FULL size then holds a graph for each query length, so a uniform
    decode never falls to PIECEWISE below the largest size and the drafter always replays
    the target's graph.

    The price: a batch pads up to the next multiple (12 tokens for query lengths 1 to 4),
    and fewer sizes means coarser padding between them.

    Raises:
        ValueError: no multiple of the query lengths fits in ``max_num_tokens``.
    """
    step = math.lcm(*query_lens)
    if step > max_num_tokens:
        raise ValueError(f"engine_kwargs.max_num_batched_tokens: {max_num_tokens} is below "
                         f"{step}, the least multiple of the query lengths {list(query_lens)}")
    aligned = set()
    for size in capture_sizes:
        up = math.ceil(size / step) * step
        aligned.add(up if up <= max_num_tokens else max_num_tokens // step * step)
    return sorted(aligned)
