"""The ``shm`` weight-transfer backend, inside vLLM's worker processes.

vLLM's weight-transfer API (``start_weight_update`` / ``start_draft_weight_update``
-> ``update_weights`` -> ``finish_weight_update``) calls this engine in every
worker. It maps the trainer's shared-memory segment and feeds zero-copy tensor
views to the target model's own ``load_weights``, wrapped in vLLM's layerwise
reload so the CPU and quantized paths re-run their post-load processing. The
service sends the same update to the main-model session and to the drafter
session: the drafter's ``load_weights`` keeps only its MTP layers and the shared
embedding and head, so the trainer writes the bytes once.

Registered under the name ``shm`` by :mod:`rollout_service.engines.vllm_plugin`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.reload.layerwise import (
    finalize_layerwise_reload,
    initialize_layerwise_reload,
)

from rollout_service.weights.shm import Segment


@dataclass
class ShmInitInfo(WeightTransferInitInfo):
    """Nothing to set up: segments are named per update."""


@dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):
    """Where the tensors of one update lie."""

    segment: str
    """Segment name under /dev/shm."""
    tensors: list[list[Any]] = field(default_factory=list)
    """``[name, dtype name, shape, byte offset]`` per tensor, validated by the service."""


class ShmWeightTransferEngine(WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]):
    """Loads checkpoint-named tensors from a shared-memory segment."""

    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo
    supports_draft_weight_update = True

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        segment = Segment.attach(update_info.segment)
        try:
            self.model.load_weights(
                (name, segment.tensor(offset, getattr(torch, dtype), tuple(shape)))
                for name, dtype, shape, offset in update_info.tensors)
        finally:
            segment.close()

    def shutdown(self) -> None:
        pass


class RolloutWorkerExtension:
    """Methods mixed into vLLM's worker (``worker_extension_cls``) for checks."""

    def rollout_weight_checksums(self) -> dict[str, str]:
        """SHA-256 over all parameters of the main model and of the drafter.

        Tests compare these before and after a rejected push: they must not move.
        """
        models = {"main": self.get_model(), "draft": self.get_draft_model()}  # type: ignore[attr-defined]
        digests = {}
        for role, model in models.items():
            if model is None:
                continue
            digest = hashlib.sha256()
            for name, param in sorted(model.named_parameters()):
                digest.update(name.encode())
                digest.update(param.detach().cpu().contiguous().view(-1).view(torch.uint8)
                              .numpy().tobytes())
            digests[role] = digest.hexdigest()
        return digests
