"""vLLM behind the service, and this project's code that runs inside vLLM's processes.

- ``engine``: ``AsyncLLM`` with MTP and per-request spec-decode stats (service process).
- ``plugin``: the ``vllm.general_plugins`` entry point registering the weight-transfer
  backends below in every vLLM process, and the engine core's run-time K schedule
  (``patches/spec_schedule.py``).
- ``spec_schedule``: the K schedule as vLLM's batch-size ranges (service process, pure).
- ``step_costs``: a stat logger turning engine steps into step-cost samples (service
  process).
- ``shm_backend``, ``cuda_ipc_backend``: the two weight-transfer backends (worker processes).
- ``worker_ext``: methods mixed into vLLM's worker (parameter checksums).
- ``patches/``: fixes of vLLM bugs, each behind its own entry point, and the run-time K
  schedule (see its README).
"""
