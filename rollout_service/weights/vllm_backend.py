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
import os
from collections.abc import Iterable
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

from rollout_service.weights.shm import Segment, segment_path


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

    _mapped: tuple[tuple[str, int, int], Segment] | None = None

    def _segment(self, name: str) -> Segment:
        """The mapped segment, kept across updates while it is the same file.

        The trainer reuses one segment for its whole run, and the main model and
        the drafter read the same bytes: mapping it once saves a map per model
        per push. A replaced file (new inode or size) is mapped anew.
        """
        stat = os.stat(segment_path(name))
        identity = (name, stat.st_ino, stat.st_size)
        if self._mapped is None or self._mapped[0] != identity:
            self._release()
            self._mapped = (identity, Segment.attach(name))
        return self._mapped[1]

    def _release(self) -> None:
        if self._mapped is not None:
            self._mapped[1].close()
            self._mapped = None

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        segment = self._segment(update_info.segment)
        self.model.load_weights(
            (name, segment.tensor(offset, getattr(torch, dtype), tuple(shape)))
            for name, dtype, shape, offset in update_info.tensors)

    def shutdown(self) -> None:
        self._release()


class RolloutWorkerExtension:
    """Methods mixed into vLLM's worker (``worker_extension_cls``) for checks."""

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

    def rollout_weight_checksums(self) -> dict[str, str]:
        """SHA-256 over the main model's parameters and over the drafter's own ones.

        vLLM shares the embedding and the head between an MTP drafter and its
        target; those count as the main model's, so the drafter digest moves only
        when a drafter-only tensor (the MTP layers) changes. Tests compare these
        before and after a rejected push: they must not move.
        """
        main = self.get_model()  # type: ignore[attr-defined]
        draft = self.get_draft_model()  # type: ignore[attr-defined]
        main_storage = {p.untyped_storage().data_ptr() for p in main.parameters()}
        digests = {"main": _digest(main.named_parameters())}
        if draft is not None:
            digests["draft"] = _digest(
                (name, p) for name, p in draft.named_parameters()
                if p.untyped_storage().data_ptr() not in main_storage)
        return digests


def _digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    digest = hashlib.sha256()
    for name, param in sorted(named, key=lambda item: item[0]):
        digest.update(name.encode())
        digest.update(param.detach().cpu().contiguous().view(-1).view(torch.uint8)
                      .numpy().tobytes())
    return digest.hexdigest()
