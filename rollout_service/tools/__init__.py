"""Developer and operator tools: not imported by the service or the trainer.

- ``launch``: run ``rollout-service serve`` as a child process (demo, tests, benchmarks).
- ``demo``: a rollout batch with per-request acceptance.
- ``rl_demo``: the RL loop twice (drafter synced vs never) and its plot.
- ``look``: key panels from Prometheus as a PNG.
- ``plot``: matplotlib figures for both.
- ``scrape``: sums over one ``/metrics`` page.
"""
