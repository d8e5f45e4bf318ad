"""``tools/scrape.py``: a scrape read as PromQL's ``sum(name{labels})`` would read it,
on pages rendered by prometheus-client itself."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from rollout_service.tools.scrape import histogram_mean, sample_sum

LABELS = st.sampled_from(["a", "b", "c"])


def page(tokens: dict[str, int], running: float, latencies: list[float]) -> str:
    """A page with names that share prefixes: a counter, a gauge named like its prefix and
    one named after it, and a histogram."""
    registry = CollectorRegistry()
    counter = Counter("gen_tokens", "tokens", ["model"], registry=registry)
    for model, value in tokens.items():
        counter.labels(model).inc(value)
    Gauge("gen", "prefix of the counter", registry=registry).set(1000)
    Gauge("gen_tokens_total_rate", "the counter's name as a prefix",
          registry=registry).set(2000)
    Gauge("running", "requests", registry=registry).set(running)
    histogram = Histogram("latency_s", "latency", registry=registry)
    for value in latencies:
        histogram.observe(value)
    return generate_latest(registry).decode()


@given(st.dictionaries(LABELS, st.integers(0, 10**6), max_size=3), st.floats(0, 100),
       st.lists(st.floats(0, 10), max_size=5), LABELS)
def test_sums_match_the_samples_whatever_shares_the_name(
        tokens: dict[str, int], running: float, latencies: list[float], model: str) -> None:
    text = page(tokens, running, latencies)
    assert sample_sum(text, "gen_tokens_total") == sum(tokens.values())
    assert sample_sum(text, "gen_tokens_total", model=model) == tokens.get(model, 0.0)
    assert sample_sum(text, "gen") == 1000
    assert sample_sum(text, "running") == running
    assert sample_sum(text, "latency_s_count") == len(latencies)
    assert sample_sum(text, "missing") == 0
    expected = sum(latencies) / len(latencies) if latencies else None
    mean = histogram_mean(text, "latency_s")
    assert mean == expected if expected is None else abs(mean - expected) < 1e-9
