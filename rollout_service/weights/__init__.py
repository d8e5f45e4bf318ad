"""Weight pushes from the trainer into the served model and its MTP drafter.

- ``checkpoint``: the names, shapes and dtypes a push is validated against.
- ``shm``: POSIX shared-memory segments (trainer writes, engine workers read).
- ``cuda_ipc``: CUDA IPC handles as JSON (trainer exports, engine workers open).
- ``session``: one push's state machine in the service process.
- ``metrics``: version gauges and push counters.
- ``vllm_backend``: the ``shm`` backend of vLLM's weight-transfer API, running in
  vLLM's worker processes (registered by ``engines.vllm_plugin``).
- ``vllm_cuda_ipc``: the ``cuda_ipc`` backend (CUDA only), likewise.
"""
