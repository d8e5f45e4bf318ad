"""Weight pushes from the trainer into the served model and its MTP drafter.

- ``intake``: everything before a byte loads: announcement, buckets, abort, expiry,
  validation (shared by the standalone service and the Ray Serve coordinator).
- ``manager``: one engine's served versions and its loads (pause, load main and
  drafter, reset the prefix cache, resume).

The data paths are in ``protocol`` (``shm``, ``cuda_ipc``); the engine side of
each lives with its engine (``engines/vllm/*_backend.py``).
"""
