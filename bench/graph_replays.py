"""Which CUDA graphs an engine replayed, step by step: for telling a graph that fails on
its first replay from one that ran many times before a failure (the speculation
control's crash on the H200, docs/speculation-control.md).

Runs in the process that owns the ``AsyncLLM`` (a bench's), as the engine's step-cost
monitor: vLLM's stat logger hands it each step's scheduler stats, which carry the
step's ``CUDAGraphStat`` (its graph mode and padded token count) when the engine runs
with the engine argument ``cudagraph_metrics``, and the step's spec-decoding counts, from
which the query length of a uniform decode follows (K verified + 1).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

from rollout_service.engines.vllm.step_costs import StepCostMonitor

MIXED = -1
"""``GraphKey.query_len`` of a step whose requests verified different numbers of drafts
(no uniform-decode graph fits it)."""


@dataclass(frozen=True, slots=True, order=True)
class GraphKey:
    """One kind of step, as the graph it ran."""

    mode: str
    """vLLM's ``CUDAGraphMode`` of the step: ``FULL``, ``PIECEWISE`` or ``NONE``."""
    num_padded_tokens: int
    """Tokens of the graph (the step's tokens, padded up to a captured size)."""
    query_len: int
    """Tokens per request: drafts verified + 1 (1 without drafts; :data:`MIXED`)."""
    is_uniform: bool = False
    """A uniform decode: every request verified ``query_len - 1`` drafts and no other
    token ran (prefills, requests without drafts). Unknown, so False, without drafts."""

    def __str__(self) -> str:
        query = "mixed" if self.query_len == MIXED else f"q={self.query_len}"
        return f"{self.mode} {self.num_padded_tokens} tokens {query}"


def graph_key(scheduler_stats: Any) -> GraphKey | None:
    """The graph one step ran, from vLLM's ``SchedulerStats`` (None: no graph stats, the
    engine runs without ``cudagraph_metrics``)."""
    graph = getattr(scheduler_stats, "cudagraph_stats", None)
    if graph is None:
        return None
    spec = scheduler_stats.spec_decoding_stats
    is_uniform = False
    if spec is None or spec.num_drafts == 0:
        query_len = 1
    else:
        k, rest = divmod(spec.num_draft_tokens, spec.num_drafts)
        query_len = MIXED if rest else k + 1
        is_uniform = not rest and graph.num_unpadded_tokens == spec.num_drafts * query_len
    mode = str(graph.runtime_mode).removeprefix("CUDAGraphMode.")
    return GraphKey(mode=mode, num_padded_tokens=graph.num_padded_tokens, query_len=query_len,
                    is_uniform=is_uniform)


class GraphReplayMonitor(StepCostMonitor):
    """A :class:`StepCostMonitor` that also counts the graphs the steps ran."""

    def __init__(self, *, num_last: int = 16) -> None:
        super().__init__()
        self.counts: collections.Counter[GraphKey] = collections.Counter()
        """Steps per graph since the engine started serving."""
        self.last: collections.deque[GraphKey] = collections.deque(maxlen=num_last)
        """The graphs of the last steps whose stats arrived (before a failure: the
        steps before the one that failed)."""

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        super().record(scheduler_stats, iteration_stats)
        key = graph_key(scheduler_stats)
        if key is not None:
            self.counts[key] += 1
            self.last.append(key)

    def shadowed_decodes(self) -> dict[GraphKey, int]:
        """Uniform decodes that ran PIECEWISE: the nearest FULL size held other query
        lengths only (vllm-project/vllm#56136), the setting in which the drafter replays a
        FULL graph of more requests (``engines/vllm/graph_ladder.py``). None with the
        service's aligned capture sizes, up to the largest."""
        return {k: n for k, n in self.counts.items() if k.is_uniform and k.mode == "PIECEWISE"}

    def report(self, *, num_top: int = 12) -> list[str]:
        """Lines for a bench's output: the FULL graphs replayed at query lengths above 1
        (the suspects), the most frequent graphs, and the last steps'."""
        if not self.counts:
            return ["graphs: no stats (the engine runs without cudagraph_metrics)"]
        suspects = sorted((k for k in self.counts if k.mode == "FULL" and k.query_len > 1),
                          key=lambda k: (k.query_len, k.num_padded_tokens))
        lines = [f"graphs: {sum(self.counts.values())} steps, {len(self.counts)} kinds"]
        lines += [f"  FULL q>1: {k}: {self.counts[k]} steps" for k in suspects]
        lines += [f"  uniform decode run PIECEWISE: {k}: {n} steps"
                  for k, n in sorted(self.shadowed_decodes().items())]
        lines += [f"  top: {k}: {n} steps" for k, n in self.counts.most_common(num_top)]
        lines.append("  last steps: " + "; ".join(str(k) for k in self.last))
        return lines
