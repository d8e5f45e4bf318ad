"""vLLM plugin (entry point group ``vllm.general_plugins``): registers our transports and
the run-time K schedule.

vLLM calls every ``vllm.general_plugins`` entry point in each of its processes
(front end, engine core, workers), so the backend names resolve wherever vLLM
builds its weight-transfer engine: ``shm`` (shared memory, CPU and GPU) and
``cuda_ipc`` (CUDA IPC handles as JSON, GPU only) and ``rollout_nccl`` (the ``nccl``
transport: one broadcast per push in a collective group). Backend modules are imported
lazily, only by the engine that uses them. The same call adds the engine core's two
schedule methods (``patches/spec_schedule.py``: added, nothing replaced; fenced to the
vLLM versions it lists), which the speculation controller calls. Neither changes
anything else in vLLM: a plain ``vllm serve`` in the same environment behaves as
without it. Patches of vLLM bugs have entry points of their own (``patches/README.md``).
"""

from __future__ import annotations

BACKENDS: dict[str, tuple[str, str]] = {
    "shm": ("rollout_service.engines.vllm.shm_backend", "ShmWeightTransferEngine"),
    "cuda_ipc": ("rollout_service.engines.vllm.cuda_ipc_backend", "CudaIpcWeightTransferEngine"),
    "rollout_nccl": ("rollout_service.engines.vllm.broadcast_backend",
                     "BroadcastWeightTransferEngine"),
}
"""vLLM weight-transfer backend name -> class."""
BACKEND_OF_TRANSPORT: dict[str, str] = {"shm": "shm", "cuda_ipc": "cuda_ipc",
                                        "nccl": "rollout_nccl"}
"""The service's ``weights_transport`` -> the backend name (vLLM has an ``nccl`` of its own)."""


def register() -> None:
    """Register the weight-transfer backends and add the run-time K schedule to vLLM's
    engine core (both idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from rollout_service.engines.vllm.patches import spec_schedule

    spec_schedule.apply()

    for name, (module, class_name) in BACKENDS.items():
        try:
            WeightTransferEngineFactory.register_engine(name, module, class_name)
        except ValueError:  # already registered in this process
            pass
