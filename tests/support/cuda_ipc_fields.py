"""Requests for the ``cuda_ipc`` transport's unit tests (``tests/unit/rollout_service/
test_cuda_ipc_{wire,intake}.py``): a two-tensor checkpoint, a well-formed CUDA IPC handle
as a trainer on cuda:0 would send it (or a 64-byte staging buffer's), the push's begin,
a placement, and pydantic errors as ``field: message`` text. Plain data; no GPU.
"""

from __future__ import annotations

import base64

from pydantic import ValidationError

from rollout_service.protocol import messages
from rollout_service.protocol.tensors import TensorMeta

CHECKPOINT = {"w": TensorMeta(shape=(4, 3), dtype="bfloat16"),
              "b": TensorMeta(shape=(3,), dtype="float32")}


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def handle_fields(**changes: object) -> dict:
    """A well-formed description (fields as a trainer on cuda:0 would send them)."""
    fields = {"gpu_uuid": "GPU-8c2a7e0e-0000-0000-0000-000000000000", "shape": [4, 3],
              "stride": [3, 1], "storage_offset": 0, "dtype": "bfloat16",
              "storage_handle": b64(bytes(range(64))), "storage_size_bytes": 24,
              "storage_offset_bytes": 512, "ref_counter_handle": b64(b"/torch_123_456_0"),
              "ref_counter_offset": 7, "event_handle": b64(bytes(64)),
              "event_sync_required": True}
    fields.update(changes)
    return fields


def begin(transport: str = "cuda_ipc", **changes: object) -> messages.PushBeginRequest:
    body = {"version": 3, "transport": transport, "total_bytes": 36,
            "params": [{"name": n, "shape": list(m.shape), "dtype": m.dtype}
                       for n, m in CHECKPOINT.items()]}
    body.update(changes)
    return messages.PushBeginRequest.model_validate(body)


def field_errors(exc: ValidationError) -> str:
    return " | ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())


def placed(name: str, handle: dict, **changes: object) -> dict:
    """A cuda_ipc placement as a trainer sends it."""
    meta = CHECKPOINT[name]
    body = {"name": name, "dtype": meta.dtype, "shape": list(meta.shape),
            "location": {"transport": "cuda_ipc", "handle": handle}}
    body.update(changes)
    return body


BUFFER = {"shape": [64], "stride": [1], "dtype": "uint8", "storage_size_bytes": 64}
"""A byte buffer of 64 bytes (the trainer's staging buffer)."""
