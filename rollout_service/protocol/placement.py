"""Where one pushed tensor lies: one description from the trainer to vLLM's loader.

A :class:`TensorPlacement` is built by the trainer (``WeightPusher``), sent in
``/weights/update``, checked by the service against the push's announcement
(``weights.intake``), kept unchanged in the engine's ``WeightUpdate``, serialized
into vLLM's ``update_info`` and parsed back in the worker process that maps the
bytes. Every layer reads the same fields; the transport is stated by the
location's ``transport`` tag, never inferred.

No torch here: the service process validates placements without it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollout_service.protocol.cuda_ipc import CudaIpcHandle
from rollout_service.protocol.shm import SEGMENT_NAME_PATTERN
from rollout_service.protocol.tensors import DTYPE_BYTES, Dim, Dtype, TensorMeta, numel

_FROZEN = ConfigDict(extra="forbid", frozen=True)


def _tag_required(schema: dict[str, Any]) -> None:
    # The tag has a default for Python callers, but a location on the wire is told apart
    # by it (the discriminator), so the wire needs it.
    schema.setdefault("required", []).insert(0, "transport")


_LOCATION = ConfigDict(**_FROZEN, json_schema_extra=_tag_required)

Transport = Literal["shm", "cuda_ipc", "nccl"]
"""Data path of a weight push: a shared-memory segment on one host, CUDA memory
shared by IPC handle (trainer and engine on the same GPU), or a broadcast from the
trainer to every engine worker in a collective group (``nccl``: NCCL between GPUs,
gloo where the engine runs on the CPU)."""


class ShmLocation(BaseModel):
    """The tensor's bytes at ``offset`` in the trainer's shared-memory ``segment``."""

    model_config = _LOCATION

    transport: Literal["shm"] = "shm"
    segment: str = Field(pattern=SEGMENT_NAME_PATTERN, description=(
        "Segment name under /dev/shm; the push's segment (checked by the service)."))
    offset: int = Field(ge=0, description="Byte offset of the tensor in the segment.")


class CudaIpcLocation(BaseModel):
    """The tensor's CUDA memory, shared by the trainer as an IPC handle: the tensor
    itself, a byte buffer holding it at ``offset``, or, without a handle, the push's
    staging buffer at ``offset`` (``cuda_ipc_buffer`` in begin).

    The staging buffer is named once per push, not once per tensor: its ~600-byte handle
    in each of the 1.14B model's 307 placements, built by the trainer and validated by
    the service and again by each worker load, cost 39 ms of control path on the 2-core
    machine against 15 ms with offsets alone (``bench/push_messages.py``)."""

    model_config = _LOCATION

    transport: Literal["cuda_ipc"] = "cuda_ipc"
    handle: CudaIpcHandle | None = Field(None, description=(
        "The tensor's own export, or a byte buffer (1-D uint8) holding it at offset; "
        "absent: the tensor lies in the push's staging buffer (begin's cuda_ipc_buffer)."))
    offset: int = Field(0, ge=0, description=(
        "Byte offset of the tensor in the byte buffer (the handle's, or the push's staging "
        "buffer); 0 when the handle is the tensor itself."))


class BroadcastLocation(BaseModel):
    """The tensor's bytes at ``offset`` in the push's byte stream, which the trainer
    broadcasts to every engine worker bucket by bucket, each during its own
    ``/weights/update`` (transport ``nccl``); the server's stored copy holds the stream at
    the same offsets."""

    model_config = _LOCATION

    transport: Literal["nccl"] = "nccl"
    offset: int = Field(ge=0, description="Byte offset of the tensor in the push's stream.")


Location = Annotated[ShmLocation | CudaIpcLocation | BroadcastLocation,
                     Field(discriminator="transport")]


class TensorPlacement(BaseModel):
    """One tensor of a push: its checkpoint name, dtype, shape, and where its bytes are."""

    model_config = _FROZEN

    name: str = Field(min_length=1, max_length=512, description="Checkpoint (HF) name.")
    dtype: Dtype = Field(description="torch dtype name without the prefix, e.g. 'bfloat16'.")
    shape: tuple[Dim, ...] = Field(max_length=8)
    location: Location

    @model_validator(mode="after")
    def _handle_matches(self) -> TensorPlacement:
        if isinstance(self.location, CudaIpcLocation) and self.location.handle is not None:
            try:
                self.location.handle.check_holds(self.shape, self.dtype, self.location.offset)
            except ValueError as exc:
                raise ValueError(f"location.{exc} (tensor {self.name!r})") from exc
        return self

    @property
    def transport(self) -> Transport:
        return self.location.transport

    @property
    def meta(self) -> TensorMeta:
        return TensorMeta(shape=self.shape, dtype=self.dtype)

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * DTYPE_BYTES[self.dtype]

    @property
    def element_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]
