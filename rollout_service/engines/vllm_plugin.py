"""vLLM plugin (entry point group ``vllm.general_plugins``): registers ``shm``.

vLLM calls every ``vllm.general_plugins`` entry point in each of its processes
(front end, engine core, workers), so the backend name resolves wherever vLLM
builds its weight-transfer engine. The backend module is imported lazily. On
the CPU platform it also installs the speculative-sampling fix of
:mod:`rollout_service.engines.vllm_cpu_sampling_fix`.
"""

from __future__ import annotations

BACKEND_NAME = "shm"


def register() -> None:
    """Register the ``shm`` weight-transfer backend (idempotent), fix CPU sampling."""
    from rollout_service.engines import vllm_cpu_sampling_fix

    vllm_cpu_sampling_fix.apply()
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(
            BACKEND_NAME, "rollout_service.weights.vllm_backend", "ShmWeightTransferEngine")
    except ValueError:  # already registered in this process
        pass
