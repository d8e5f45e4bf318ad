"""The disk-reload baseline of ``bench/weight_sync.py``, inside vLLM's worker processes.

Set as ``worker_extension_cls`` of the baseline engine only; the service never
loads it.
"""

from __future__ import annotations

from typing import Any

from rollout_service.engines.vllm.worker_ext import RolloutWorkerExtension


class DiskReloadExtension(RolloutWorkerExtension):
    """The service's worker extension plus a reload from a safetensors file."""

    def rollout_load_safetensors(self, path: str, draft: bool) -> None:
        """Reload one model from a safetensors file through the same reload session.

        The "save a checkpoint, reload it from disk" alternative that
        ``bench/weight_sync.py`` compares the shm push against.
        """
        from safetensors import safe_open

        worker: Any = self
        if draft:
            worker.start_draft_weight_update()
        else:
            worker.start_weight_update()
        with safe_open(path, framework="pt") as f:
            worker.weight_transfer_engine.model.load_weights(
                (name, f.get_tensor(name)) for name in f.keys())
        worker.finish_weight_update()
