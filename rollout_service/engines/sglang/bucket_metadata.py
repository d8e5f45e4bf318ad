"""SGLang's ``flattened_bucket`` metadata of a push: where each tensor lies in the byte
buffer that carries it, whichever transport brought the buffer (a shared-memory segment,
``payload.py``; the trainer's CUDA memory, ``cuda_ipc_payload.py``)."""

from __future__ import annotations

from typing import Any

from rollout_service.engines.base import WeightUpdate


def flattened_metadata(update: WeightUpdate) -> list[Any]:
    """One ``FlattenedTensorMetadata`` per tensor of ``update``, at its byte offset in the
    buffer (``placement.location.offset``); SGLang slices the bucket by these bytes.

    Raises:
        RuntimeError: sglang is not installed in this process's environment.
    """
    import torch

    try:
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata
    except ImportError as exc:
        raise RuntimeError(
            "pushing weights to SGLang needs the sglang package in the rollout service's "
            f"environment (the payload names its FlattenedTensorMetadata): {exc}") from exc
    metadata = []
    for placement in update.tensors:
        start = placement.location.offset
        metadata.append(FlattenedTensorMetadata(
            name=placement.name, shape=torch.Size(placement.shape),
            dtype=getattr(torch, placement.dtype), start_idx=start,
            end_idx=start + placement.nbytes, numel=placement.nbytes))
    return metadata
