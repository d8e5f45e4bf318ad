"""Prometheus exporters of the service, and every PromQL expression that reads them.

- ``acceptance``: per-request acceptance counters and histograms.
- ``weights``: served weight versions and push outcomes.
- ``exposition``: one ``/metrics`` page: vLLM's series beside the service's.
- ``queries``: every derived figure as PromQL, once; the docs, the dashboards, the
  alert rules and ``rollout-service look`` read them from here.
"""
