"""bench/graph_replays.py on vLLM's own stats objects: the graph of a step and what the
monitor counts and reports. The whole path (an engine with ``cudagraph_metrics`` feeding
the monitor) runs in ``bench.spec_churn`` on the CPU engine, where every step is
``NONE``."""

from __future__ import annotations

from vllm.compilation.cuda_graph import CUDAGraphStat
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.spec_decode.metrics import SpecDecodingStats

from bench.graph_replays import MIXED, GraphKey, GraphReplayMonitor, graph_key


def step(mode: str, num_tokens: int, num_padded_tokens: int, drafts: list[int] | None
         ) -> SchedulerStats:
    """One step's stats as vLLM's scheduler makes them: ``drafts`` per request."""
    spec = None
    if drafts is not None:
        spec = SpecDecodingStats.new(3)
        for num_draft_tokens in drafts:
            spec.observe_draft(num_draft_tokens, 0)
    return SchedulerStats(spec_decoding_stats=spec, cudagraph_stats=CUDAGraphStat(
        num_unpadded_tokens=num_tokens, num_padded_tokens=num_padded_tokens,
        num_paddings=num_padded_tokens - num_tokens, runtime_mode=f"CUDAGraphMode.{mode}"))


def test_the_graph_of_a_step() -> None:
    # The H200 crash's step: 229 requests verifying one draft each, padded to 232.
    assert graph_key(step("FULL", 458, 464, [1] * 229)) == GraphKey(
        mode="FULL", num_padded_tokens=464, query_len=2, is_uniform=True)
    # The same drafts beside a prefill of 40 tokens: not a uniform decode.
    assert not graph_key(step("PIECEWISE", 498, 512, [1] * 229)).is_uniform
    assert not graph_key(step("FULL", 8, 8, None)).is_uniform  # no drafts: unknown
    assert graph_key(step("FULL", 8, 8, None)).query_len == 1  # no speculation
    assert graph_key(step("PIECEWISE", 40, 40, [])).query_len == 1  # K = 0
    assert graph_key(step("PIECEWISE", 40, 40, [1, 2])).query_len == MIXED
    assert graph_key(SchedulerStats()) is None  # no cudagraph_metrics


def test_the_monitor_counts_and_reports_the_suspects() -> None:
    monitor = GraphReplayMonitor(num_last=2)
    assert monitor.report() == ["graphs: no stats (the engine runs without cudagraph_metrics)"]
    for stats in [step("FULL", 458, 464, [1] * 229)] * 3 + [
            step("FULL", 232, 232, [0] * 232), step("PIECEWISE", 300, 304, [1, 2])]:
        monitor.record(stats, None)
    assert monitor.counts[GraphKey(mode="FULL", num_padded_tokens=464, query_len=2,
                                   is_uniform=True)] == 3
    assert sum(monitor.counts.values()) == 5
    report = monitor.report()
    assert report[0] == "graphs: 5 steps, 3 kinds"
    assert report[1] == "  FULL q>1: FULL 464 tokens q=2: 3 steps"  # the only suspect
    assert not any(line.startswith("  FULL q>1: FULL 232") for line in report)
    assert report[-1] == "  last steps: FULL 232 tokens q=1; PIECEWISE 304 tokens mixed"


def test_uniform_decodes_run_piecewise_are_reported() -> None:
    """A uniform decode whose FULL graph was shadowed ran PIECEWISE (33 requests at K = 1
    padded to 72 tokens); a mixed step run PIECEWISE is not one."""
    monitor = GraphReplayMonitor()
    for stats in [step("PIECEWISE", 66, 72, [1] * 33)] * 2 + [
            step("PIECEWISE", 100, 104, [1] * 33), step("FULL", 64, 64, [1] * 32)]:
        monitor.record(stats, None)
    shadowed = GraphKey(mode="PIECEWISE", num_padded_tokens=72, query_len=2, is_uniform=True)
    assert monitor.shadowed_decodes() == {shadowed: 2}
    assert "  uniform decode run PIECEWISE: PIECEWISE 72 tokens q=2: 2 steps" in monitor.report()
