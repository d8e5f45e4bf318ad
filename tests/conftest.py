"""Settings for the whole suite.

Hypothesis: no per-example deadline. Its default (200 ms) is a timing assertion, and
`make test` must pass on a busy 2-core machine, where a first torch call can take longer
than that (``test_vllm_cpu_sampling_fix.py::test_expand_matches_reference`` failed so once).
What the property tests check is correctness; speed has its benchmarks under bench/.
"""

from hypothesis import settings

settings.register_profile("suite", deadline=None)
settings.load_profile("suite")
