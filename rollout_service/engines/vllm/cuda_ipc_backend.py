"""The ``cuda_ipc`` weight-transfer backend, inside vLLM's worker processes (CUDA only).

vLLM's built-in ``ipc`` backend (``IPCWeightTransferEngine``) takes the trainer's
``reduce_tensor`` argument tuples, which hold bytes and classes: over HTTP they
travel only pickled (``ipc_handles_pickled``, refused unless
``VLLM_ALLOW_INSECURE_SERIALIZATION``). This subclass replaces its session
handling with ``transfer.LoadSession`` (a layerwise reload, or a copy in place
where the weights are used as loaded) and the update info with JSON-safe placements
(:class:`~rollout_service.protocol.placement.TensorPlacement` with a
:class:`~rollout_service.protocol.cuda_ipc.CudaIpcHandle`), checked and opened
by :mod:`rollout_service.protocol.cuda_ipc`. The pickled path is never used.

The main model and the drafter load the same push from the same handles: they
are opened once, by the first load of the push, kept for the second and released
after the last one (``is_last_load``). Tensors that share one export (the trainer's
staging buffer: every tensor of a push in one byte buffer) share one open, and each
is a view into it at its offset. Opening an export twice makes the
receiver return torch's reference count twice, and the trainer's memory behind
it stays in torch's IPC limbo for good (measured on an H200: 64 MiB still
allocated after the trainer freed the tensor and called ``ipc_collect``).

Scope: one trainer GPU and engine workers on that same GPU (tensor parallel size
1); a worker on another GPU refuses the handles (``gpu_uuid``).

Registered under the name ``cuda_ipc`` by :mod:`rollout_service.engines.vllm.plugin`.
"""

from __future__ import annotations

import torch
from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

from rollout_service.engines.vllm.transfer import PushUpdateInfo, SessionLoads
from rollout_service.protocol.cuda_ipc import CudaIpcHandle, open_handle
from rollout_service.protocol.placement import CudaIpcLocation, TensorPlacement
from rollout_service.protocol.tensors import view_in


class CudaIpcWeightTransferEngine(SessionLoads, IPCWeightTransferEngine):
    """vLLM's IPC engine with JSON handles, opened once per push for both models."""

    update_info_cls = PushUpdateInfo  # type: ignore[assignment]
    supports_draft_weight_update = True

    _opened: tuple[str, list[tuple[str, torch.Tensor]]] | None = None

    def receive_weights(self, update_info: PushUpdateInfo) -> None:  # type: ignore[override]
        try:
            update_info.check_transport("cuda_ipc")
            self._load(update_info, "cuda_ipc", self._open(update_info))
        finally:
            if update_info.is_last_load:
                self._opened = None  # closes the mappings; the trainer may free its copies

    def _open(self, info: PushUpdateInfo) -> list[tuple[str, torch.Tensor]]:
        if self._opened is not None and self._opened[0] == info.push_id:
            return self._opened[1]
        self._opened = None  # an earlier push that never reached its last load
        device_index = self.device.index
        assert device_index is not None, self.device
        weights = open_placements(info.placements, device_index, info.staging_buffer)
        self._opened = (info.push_id, weights)
        return weights

    def shutdown(self) -> None:
        self._opened = None
        super().shutdown()


def open_placements(placements: list[TensorPlacement], device_index: int,
                    staging_buffer: CudaIpcHandle | None = None
                    ) -> list[tuple[str, torch.Tensor]]:
    """Each placement's tensor, every export opened exactly once (torch counts opens):
    a placement's own handle, or the push's staging buffer for those without one."""
    opened: dict[tuple[str, str, int], torch.Tensor] = {}
    weights = []
    for placement in placements:
        location = placement.location
        assert isinstance(location, CudaIpcLocation)  # PushUpdateInfo checked the transport
        handle = location.handle or staging_buffer
        assert handle is not None  # PushUpdateInfo checked there is a buffer
        key = handle.export_key
        if key not in opened:
            opened[key] = open_handle(handle, device_index=device_index)
        weights.append((placement.name, view_in(opened[key], location.offset,
                                                placement.shape, placement.dtype)))
    return weights
