"""vLLM behind the service, and this project's code that runs inside vLLM's processes.

- ``engine``: ``AsyncLLM`` with MTP and per-request spec-decode stats (service process).
- ``plugin``: the ``vllm.general_plugins`` entry point registering the weight-transfer
  backends below in every vLLM process.
- ``shm_backend``, ``cuda_ipc_backend``: the two weight-transfer backends (worker processes).
- ``worker_ext``: methods mixed into vLLM's worker (parameter checksums).
- ``patches/``: fixes of vLLM bugs, each behind its own entry point (see its README).
"""
