"""Read one ``/metrics`` page without a Prometheus server (demo and tests).

Runs in the caller's process. For one scrape, :func:`sample_sum` is what
``sum(name{labels})`` gives in PromQL, so the demo can print the macro averages
Prometheus would compute, and the tests can compare counters before and after.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def sample_sum(metrics_text: str, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``.

    Only the lines that start with ``name`` are parsed: a service's page carries all of
    vLLM's metrics, and on a busy 2-core machine a test that parsed it whole to read one
    counter saw the requests it waited on finish meanwhile.
    """
    lines = "".join(f"{line}\n" for line in metrics_text.splitlines() if line.startswith(name))
    return sum(sample.value for family in text_string_to_metric_families(lines)
               for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())


def histogram_mean(metrics_text: str, histogram: str) -> float | None:
    """``_sum / _count`` of a histogram over all its label sets (None before any sample)."""
    count = sample_sum(metrics_text, f"{histogram}_count")
    return sample_sum(metrics_text, f"{histogram}_sum") / count if count else None
