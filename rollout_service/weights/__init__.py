"""Weight pushes from the trainer into the served model and its MTP drafter.

- ``checkpoint``: the names, shapes and dtypes a push is validated against.
- ``shm``: POSIX shared-memory segments (trainer writes, engine workers read).
- ``session``: one push's state machine in the service process.
- ``metrics``: version gauges and push counters.
- ``vllm_backend``: the ``shm`` backend of vLLM's weight-transfer API, running in
  vLLM's worker processes (registered by ``engines.vllm_plugin``).
"""
