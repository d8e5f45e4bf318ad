"""vLLM plugin (entry point group ``vllm.general_plugins``): registers our transports.

vLLM calls every ``vllm.general_plugins`` entry point in each of its processes
(front end, engine core, workers), so the backend names resolve wherever vLLM
builds its weight-transfer engine: ``shm`` (shared memory, CPU and GPU) and
``cuda_ipc`` (CUDA IPC handles as JSON, GPU only). Backend modules are imported
lazily, only by the engine that uses them. On the CPU platform it also installs
the speculative-sampling fix of :mod:`rollout_service.engines.vllm_cpu_sampling_fix`.
"""

from __future__ import annotations

BACKENDS: dict[str, tuple[str, str]] = {
    "shm": ("rollout_service.weights.vllm_backend", "ShmWeightTransferEngine"),
    "cuda_ipc": ("rollout_service.weights.vllm_cuda_ipc", "CudaIpcWeightTransferEngine"),
}
"""vLLM weight-transfer backend name (= the service's ``weights_transport``) -> class."""


def register() -> None:
    """Register the weight-transfer backends (idempotent), fix CPU sampling."""
    from rollout_service.engines import vllm_cpu_sampling_fix

    vllm_cpu_sampling_fix.apply()
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    for name, (module, class_name) in BACKENDS.items():
        try:
            WeightTransferEngineFactory.register_engine(name, module, class_name)
        except ValueError:  # already registered in this process
            pass
