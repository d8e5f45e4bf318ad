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
        """Reload one model from a safetensors file through vLLM's layerwise reload.

        The "save a checkpoint, reload it from disk" alternative that
        ``bench/weight_sync.py`` compares the pushes against. It reloads the way a
        ``weights_load: reload`` push does (re-initialise each layer, load, re-run
        its post-load processing): loading into the served parameters as they are
        fails where vLLM repacks them after loading (its CPU build).
        """
        from safetensors import safe_open
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        worker: Any = self
        if draft:
            worker.start_draft_weight_update()
        else:
            worker.start_weight_update()
        engine = worker.weight_transfer_engine  # retargeted at the drafter for draft
        with set_current_vllm_config(worker.vllm_config):
            initialize_layerwise_reload(engine.model)
            with safe_open(path, framework="pt") as f:
                engine.model.load_weights((name, f.get_tensor(name)) for name in f.keys())
            finalize_layerwise_reload(engine.model, engine.model_config)
        worker.finish_weight_update()
