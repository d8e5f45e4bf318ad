"""CUDA IPC handles as JSON: the ``cuda_ipc`` transport's description of a tensor.

Three processes use this module:

- the trainer (same host and GPU as the engine) calls :func:`export_handle`:
  torch's ``reduce_tensor`` shares the tensor's CUDA memory, and the handle is
  described as a :class:`CudaIpcHandle`, sent inside ``/weights/update`` JSON;
- the service process validates the description against the announcement
  (:meth:`CudaIpcHandle.check_holds`, no torch needed);
- vLLM's worker process calls :func:`open_handle`, which checks it is on the
  same physical GPU and maps the memory with torch's ``rebuild_cuda_tensor``,
  once per export (:attr:`CudaIpcHandle.export_key`), and ``tensors.view_in`` for
  each tensor in it.

A handle either is one tensor, or is a *byte buffer* (1-D ``uint8``) that holds
many at byte offsets: the trainer's staging buffer (``trainer_client/push.py``),
one export and one open per push instead of one per tensor. Each export and open
costs tens of microseconds of driver calls plus an event to wait on, which for the
1.14B model's ~300 tensors was a sizeable share of a push on an H200.

Nothing is unpickled: the tensor and storage classes are fixed here (whatever
``reduce_tensor`` produces for a plain tensor), never named by the message, and
the dtype comes from a whitelist. torch is imported lazily, inside the functions
that need it; nothing here imports vLLM.
"""

from __future__ import annotations

import base64
import re
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rollout_service.protocol.tensors import (
    DTYPE_BYTES,
    Dim,
    Dtype,
    contiguous_stride,
    numel,
)

if TYPE_CHECKING:
    import torch

MAX_HANDLE_CHARS = 4096
"""Base64 characters per opaque handle; CUDA's are 64 bytes, torch's
expandable-segment handles a few hundred."""
BASE64 = r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{4}|[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)$"
"""A non-empty handle in padded base64: what the handle fields accept (the OpenAPI
document states it; the validator says why a value is refused)."""
_BASE64_PATTERN = re.compile(BASE64)
"""Compiled once: a staged push validates three handles per tensor, ~900 for the 1.14B model."""
Handle = Annotated[str, Field(max_length=MAX_HANDLE_CHARS, json_schema_extra={"pattern": BASE64})]


class CudaIpcHandle(BaseModel):
    """Everything ``rebuild_cuda_tensor`` needs except what the receiver fixes itself.

    Left out on purpose: the tensor and storage classes (fixed by the receiver),
    ``requires_grad`` (always False: weights are loaded, not trained, by the
    engine) and the device index (the receiver's own, once ``gpu_uuid`` shows it
    is the same physical GPU; indices differ between processes with different
    ``CUDA_VISIBLE_DEVICES``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    gpu_uuid: str = Field(min_length=1, max_length=64, description=(
        "Physical GPU holding the memory: str(torch.cuda.get_device_properties(i).uuid)."))
    shape: list[Dim] = Field(max_length=8)
    stride: list[int] = Field(max_length=8, description="Contiguous strides of shape.")
    storage_offset: int = Field(ge=0, description="Tensor offset in its storage (elements).")
    dtype: Dtype = Field(description="torch dtype name without the prefix, e.g. 'bfloat16'.")
    storage_handle: Handle = Field(description=(
        "Base64 of the CUDA memory handle of the allocation holding the storage."))
    storage_size_bytes: int = Field(gt=0)
    storage_offset_bytes: int = Field(ge=0, description="Storage offset in the allocation.")
    ref_counter_handle: Handle = Field(description=(
        "Base64 of the name of torch's shared reference-counter file."))
    ref_counter_offset: int = Field(ge=0)
    event_handle: Handle = Field(description=(
        "Base64 of the CUDA event the receiver waits on before reading."))
    event_sync_required: bool

    @field_validator("storage_handle", "ref_counter_handle", "event_handle")
    @classmethod
    def _base64(cls, value: str) -> str:
        if not value:
            raise ValueError("empty handle")
        if _BASE64_PATTERN.fullmatch(value) is None:
            raise ValueError("not valid base64 (padded, in the standard alphabet)")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> CudaIpcHandle:
        if self.stride != contiguous_stride(self.shape):
            raise ValueError(f"stride: {self.stride} is not the contiguous stride "
                             f"{contiguous_stride(self.shape)} of shape {self.shape}; "
                             "export contiguous tensors")
        end = (self.storage_offset + numel(self.shape)) * DTYPE_BYTES[self.dtype]
        if end > self.storage_size_bytes:
            raise ValueError(f"storage_size_bytes: {self.storage_size_bytes} cannot hold "
                             f"the tensor, which ends at byte {end}")
        return self

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor (not of its storage)."""
        return numel(self.shape) * DTYPE_BYTES[self.dtype]

    @property
    def is_byte_buffer(self) -> bool:
        """A 1-D ``uint8`` handle: a buffer that may hold several tensors at byte offsets."""
        return self.dtype == "uint8" and len(self.shape) == 1

    @property
    def export_key(self) -> tuple[str, str, int]:
        """What identifies one export: torch counts the receiver's opens per export (its
        reference-counter slot), so a receiver opens each key exactly once."""
        return self.storage_handle, self.ref_counter_handle, self.ref_counter_offset

    def check_holds(self, shape: tuple[int, ...] | list[int], dtype: str, offset: int) -> None:
        """Check the handle holds a tensor of this announced shape and dtype at byte
        ``offset``: it is that tensor (offset 0), or a byte buffer the tensor lies in.

        Raises:
            ValueError: naming ``handle.shape``, ``handle.dtype`` or ``offset`` (fields of
                the placement's location).
        """
        if offset == 0 and list(shape) == self.shape and dtype == self.dtype:
            return
        if not self.is_byte_buffer:
            try:
                self.check_matches(shape, dtype)
            except ValueError as exc:
                raise ValueError(f"handle.{exc}") from exc
            raise ValueError(f"offset: {offset} lies in a byte buffer only (a 1-D uint8 "
                             f"handle); this handle is the {self.dtype} tensor itself")
        element = DTYPE_BYTES[dtype]
        if offset % element:
            raise ValueError(f"offset: {offset} is not a multiple of {element}, the size of a "
                             f"{dtype} element")
        end = offset + numel(list(shape)) * element
        if end > self.nbytes:
            raise ValueError(f"offset: the tensor's bytes {offset}..{end} end past the "
                             f"buffer's {self.nbytes}")

    def check_matches(self, shape: tuple[int, ...] | list[int], dtype: str) -> None:
        """Check the handle describes a tensor of this announced shape and dtype.

        Raises:
            ValueError: naming ``shape`` or ``dtype``.
        """
        if list(shape) != self.shape:
            raise ValueError(f"shape: the handle describes {self.shape}, the announcement "
                             f"{list(shape)}")
        if dtype != self.dtype:
            raise ValueError(f"dtype: the handle describes {self.dtype}, the announcement "
                             f"{dtype}")

    def to_rebuild_args(self, device_index: int | str) -> tuple[Any, ...]:
        """The argument tuple of ``torch.multiprocessing.reductions.rebuild_cuda_tensor``,
        in its order, for a tensor on the receiver's ``device_index``: its own index, or
        the GPU's UUID for a receiver that maps it to its index itself (SGLang's patched
        ``rebuild_cuda_tensor``, ``engines/sglang/cuda_ipc_payload.py``)."""
        import torch

        return (
            torch.Tensor,                 # tensor_cls: fixed, never from the message
            torch.Size(self.shape),
            tuple(self.stride),
            self.storage_offset,
            torch.storage.TypedStorage,   # storage_cls: what reduce_tensor sends (torch 2.x)
            getattr(torch, self.dtype),   # whitelisted by _consistent
            device_index,
            base64.b64decode(self.storage_handle),
            self.storage_size_bytes,
            self.storage_offset_bytes,
            False,                        # requires_grad
            base64.b64decode(self.ref_counter_handle),
            self.ref_counter_offset,
            base64.b64decode(self.event_handle),
            self.event_sync_required,
        )


class ByteBufferHandle(CudaIpcHandle):
    """A handle of a byte buffer (1-D ``uint8``) that holds tensors at byte offsets: the
    trainer's staging buffer, named once per push (begin's ``cuda_ipc_buffer``). The
    schema states the shape and dtype, so a request that breaks them is refused as
    invalid by the document itself."""

    dtype: Literal["uint8"] = Field(description="Always 'uint8': bytes.")  # type: ignore[assignment]
    shape: list[Dim] = Field(min_length=1, max_length=1, description=(
        "[size in bytes]."))
    stride: list[int] = Field(min_length=1, max_length=1, description="[1].")


def gpu_uuid(device_index: int) -> str:
    """The physical GPU behind a CUDA device index of this process."""
    import torch

    return str(torch.cuda.get_device_properties(device_index).uuid)


def export_handle(tensor: torch.Tensor, name: str) -> CudaIpcHandle:
    """Share a contiguous CUDA tensor's memory and describe the handle (trainer process).

    The caller keeps ``tensor`` alive until the receiver is done with it: the
    handle does not hold the memory. Each call is one export; the receiver opens
    each export exactly once (torch's reference counting counts opens).

    Raises:
        ValueError: naming ``name``: not a CUDA tensor, not contiguous, or empty.
    """
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    if tensor.device.type != "cuda":
        raise ValueError(f"tensors: {name!r} is on {tensor.device}; the cuda_ipc transport "
                         "shares CUDA memory only")
    if list(tensor.stride()) != contiguous_stride(tensor.shape):
        raise ValueError(f"tensors: {name!r} has strides {list(tensor.stride())}, not the "
                         f"contiguous {contiguous_stride(tensor.shape)}")
    if tensor.numel() == 0:
        raise ValueError(f"tensors: {name!r} is empty")
    rebuild, args = reduce_tensor(tensor.detach())
    assert rebuild is rebuild_cuda_tensor, rebuild
    (_, size, stride, offset, _, dtype, device_index, storage_handle, storage_size_bytes,
     storage_offset_bytes, _, ref_counter_handle, ref_counter_offset, event_handle,
     event_sync_required) = args
    return CudaIpcHandle(
        gpu_uuid=gpu_uuid(device_index), shape=list(size), stride=list(stride),
        storage_offset=offset, dtype=str(dtype).removeprefix("torch."),
        storage_handle=_b64(storage_handle), storage_size_bytes=storage_size_bytes,
        storage_offset_bytes=storage_offset_bytes, ref_counter_handle=_b64(ref_counter_handle),
        ref_counter_offset=ref_counter_offset, event_handle=_b64(event_handle),
        event_sync_required=bool(event_sync_required))


def export_byte_buffer(buffer: torch.Tensor, name: str) -> ByteBufferHandle:
    """:func:`export_handle` of a byte buffer (1-D ``uint8``), typed as one.

    Raises:
        ValueError: ``buffer`` is not a 1-D ``uint8`` CUDA tensor.
    """
    import torch

    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError(f"{name}: a byte buffer is 1-D uint8, got {buffer.dtype} "
                         f"{list(buffer.shape)}")
    return ByteBufferHandle.model_validate(export_handle(buffer, name).model_dump())


def open_handle(handle: CudaIpcHandle, *, device_index: int) -> torch.Tensor:
    """Map the trainer's tensor (or byte buffer) into this process (vLLM worker), without
    a copy. Call once per :attr:`~CudaIpcHandle.export_key`.

    Args:
        handle: the validated description.
        device_index: this process's CUDA device that must hold the memory.

    Raises:
        ValueError: naming ``gpu_uuid`` (another physical GPU).
    """
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    local = gpu_uuid(device_index)
    if handle.gpu_uuid != local:
        raise ValueError(f"gpu_uuid: the handle's memory is on GPU {handle.gpu_uuid}, this "
                         f"process's cuda:{device_index} is {local}; cuda_ipc needs the "
                         "trainer and the engine on the same GPU")
    tensor = rebuild_cuda_tensor(*handle.to_rebuild_args(device_index))
    assert list(tensor.shape) == handle.shape and tensor.is_contiguous()
    return tensor


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")
