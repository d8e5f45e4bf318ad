"""What crosses a process boundary: messages, acceptance math, tensor descriptions.

The bottom floor of the service and the only part of it a trainer imports
(with ``rollout_service.client``). Nothing here imports FastAPI, vLLM or Ray;
torch is imported lazily, only by the functions that move tensor bytes.

- ``messages``: every HTTP message (pydantic), requests and responses.
- ``acceptance``: one sequence's spec-decode counts and a batch's summary.
- ``tensors``: names, shapes and dtypes of checkpoint tensors.
- ``placement``: where one pushed tensor lies (shared memory or a CUDA IPC handle).
- ``shm``, ``cuda_ipc``: the two data paths of weight pushes.
"""
