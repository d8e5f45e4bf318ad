"""The ``cuda_ipc`` weight-transfer backend, inside vLLM's worker processes (CUDA only).

vLLM's built-in ``ipc`` backend (``IPCWeightTransferEngine``) takes the trainer's
``reduce_tensor`` argument tuples, which hold bytes and classes: over HTTP they
travel only pickled (``ipc_handles_pickled``, refused unless
``VLLM_ALLOW_INSECURE_SERIALIZATION``). This subclass keeps its session handling
(layerwise reload in ``start_weight_update`` / ``finish_weight_update``) and
replaces the update info with JSON-safe fields: names, dtype names, shapes and
:class:`~rollout_service.weights.cuda_ipc.CudaIpcHandle` dicts, checked and
opened by :mod:`rollout_service.weights.cuda_ipc`. The pickled path is never used.

The main model and the drafter load the same push from the same handles: they
are opened once, by the first load of the push, kept for the second and released
after the last one (``is_last_load``). Opening an export twice makes the
receiver return torch's reference count twice, and the trainer's memory behind
it stays in torch's IPC limbo for good (measured on an H200: 64 MiB still
allocated after the trainer freed the tensor and called ``ipc_collect``).

Scope: one trainer GPU and engine workers on that same GPU (tensor parallel size
1); a worker on another GPU refuses the handles (``gpu_uuid``). Never run: this
repository has no CUDA build of vLLM (see the README).

Registered under the name ``cuda_ipc`` by :mod:`rollout_service.engines.vllm_plugin`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

from rollout_service.weights.cuda_ipc import CudaIpcHandle, open_handle


@dataclass
class CudaIpcUpdateInfo(WeightTransferUpdateInfo):
    """One push's tensors as CUDA IPC handles (JSON-safe; validated on construction)."""

    push_id: str
    """Names the push: the drafter's load reuses the handles the main load opened."""
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    handles: list[dict[str, Any]]
    """``CudaIpcHandle`` fields per tensor, in ``names`` order."""
    is_last_load: bool = True
    """Release the opened handles after this load."""
    parsed: list[CudaIpcHandle] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        num = len(self.names)
        for name in ("dtype_names", "shapes", "handles"):
            if len(getattr(self, name)) != num:
                raise ValueError(f"{name}: {len(getattr(self, name))} entries for {num} names")
        self.parsed = [CudaIpcHandle.model_validate(h) for h in self.handles]


class CudaIpcWeightTransferEngine(IPCWeightTransferEngine):
    """vLLM's IPC engine with JSON handles, opened once per push for both models."""

    update_info_cls = CudaIpcUpdateInfo  # type: ignore[assignment]
    supports_draft_weight_update = True

    _opened: tuple[str, list[tuple[str, torch.Tensor]]] | None = None

    def receive_weights(self, update_info: CudaIpcUpdateInfo) -> None:  # type: ignore[override]
        try:
            self.model.load_weights(iter(self._open(update_info)))
        finally:
            if update_info.is_last_load:
                self._opened = None  # closes the mappings; the trainer may free its copies

    def _open(self, info: CudaIpcUpdateInfo) -> list[tuple[str, torch.Tensor]]:
        if self._opened is not None and self._opened[0] == info.push_id:
            return self._opened[1]
        self._opened = None  # an earlier push that never reached its last load
        device_index = self.device.index
        assert device_index is not None, self.device
        weights = [(name, open_handle(handle, device_index=device_index, shape=shape,
                                      dtype=dtype))
                   for name, dtype, shape, handle in zip(info.names, info.dtype_names,
                                                         info.shapes, info.parsed)]
        self._opened = (info.push_id, weights)
        return weights

    def shutdown(self) -> None:
        self._opened = None
        super().shutdown()


def build_update_info(names: list[str], dtype_names: list[str], shapes: list[list[int]],
                      handles: list[CudaIpcHandle], *, push_id: str, is_last_load: bool
                      ) -> dict[str, Any]:
    """The ``update_info`` dict for ``update_weights`` (service process; JSON-safe)."""
    return {"push_id": push_id, "names": names, "dtype_names": dtype_names, "shapes": shapes,
            "handles": [h.model_dump(mode="json") for h in handles],
            "is_last_load": is_last_load}
