"""The decaying rollout of ``bench/speculation.py``: long-tailed, capped, reproducible."""

from __future__ import annotations

import statistics

from bench.speculation_rounds import rollout_lengths


def test_rollout_lengths_decay_from_many_short_to_a_few_long() -> None:
    lengths = rollout_lengths(512, 1024, seed=0)
    assert len(lengths) == 512 and all(1 <= n <= 1024 for n in lengths)
    assert statistics.median(lengths) < 64, "most responses are short"
    assert max(lengths) >= 512, "a few are long: concurrency decays down to one request"
    assert rollout_lengths(512, 1024, seed=0) == lengths
    assert rollout_lengths(512, 1024, seed=1) != lengths
