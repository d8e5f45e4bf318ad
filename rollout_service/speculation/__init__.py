"""Speculation control: how many draft tokens K to run at each batch size.

Speculative decoding pays at low concurrency and costs at high concurrency, and an RL
rollout step passes through both (hundreds of requests at its start, a tail of a few).
This package is the pure decision core; it runs in the rollout service process, is fed by
the service (finished sequences' stats, step-time measurements) and returns a batch size
-> K table for the engine. No engine, HTTP, Prometheus or asyncio here.

- ``acceptance``: conditional per-position acceptance, exponentially weighted in drafts,
  one epoch per drafter version with the old estimate as a prior.
- ``cost``: the measured step cost ``c(K, B)``, interpolated in ``log B``, refreshed by
  blending new samples.
- ``decision``: expected tokens per step ``E(K)``, throughput ``B * E(K) / c(K, B)``, the
  best K, hysteresis, the collapse rule and the probe settings.
- ``controller``: ``SpeculationController`` ties them: ``observe``, ``schedule``,
  ``state``.
"""
