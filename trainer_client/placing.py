"""Placing one push's tensors for the ``shm`` and ``cuda_ipc`` transports: copies into
the trainer's shared-memory segment or its CUDA staging buffer (or exports in place), and
the update calls that announce them bucket by bucket.

Runs in the trainer process, inside :class:`~trainer_client.push.WeightPusher` (the
``nccl`` transport's stream is ``bucket_stream.py``).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rollout_service.protocol import messages
from rollout_service.protocol.cuda_ipc import ByteBufferHandle, export_handle
from rollout_service.protocol.placement import (
    CudaIpcLocation,
    ShmLocation,
    TensorPlacement,
    Transport,
)
from rollout_service.protocol.shm import Segment
from rollout_service.protocol.tensors import TensorMeta, contiguous_stride, view_in


def spec_nbytes(spec: messages.ParamSpec) -> int:
    return TensorMeta(shape=tuple(spec.shape), dtype=spec.dtype).nbytes


def shareable(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """``tensor`` with contiguous strides on its CUDA device, copied only if needed.

    Raises:
        ValueError: naming the tensor, when it is not on a CUDA device.
    """
    if tensor.device.type != "cuda":
        raise ValueError(f"tensors: {name!r} is on {tensor.device}; transport 'cuda_ipc' "
                         "shares CUDA tensors only (use transport 'shm')")
    tensor = tensor.detach()
    if list(tensor.stride()) != contiguous_stride(tensor.shape):
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def copy_into(segment: Segment, offset: int, tensor: torch.Tensor, nbytes: int) -> None:
    """Copy ``tensor`` into the segment at ``offset``.

    A contiguous CPU tensor goes through one ``memmove`` on this thread: torch's
    ``copy_`` splits large copies over its intra-op threads, which on a busy host
    (the trainer's own threads, the engine's) ran 14x slower than one plain
    copy (211 MB: 1.0 s vs 0.07 s). Other tensors (GPU, strided) use ``copy_``,
    which also does the device-to-host transfer: asynchronous, into the segment
    pinned by :class:`PinnedSegment` (the caller synchronizes before announcing).
    """
    if tensor.device.type == "cpu" and tensor.is_contiguous():
        ctypes.memmove(segment.address(offset), tensor.data_ptr(), nbytes)
    else:
        segment.tensor(offset, tensor.dtype, tuple(tensor.shape)).copy_(
            tensor, non_blocking=tensor.device.type == "cuda")


def _synchronize() -> float:
    """Wait for the asynchronous device-to-host copies; returns the seconds waited."""
    start = time.perf_counter()
    torch.cuda.synchronize()
    return time.perf_counter() - start


@dataclass(kw_only=True)
class PushMemory:
    """Where one push's bytes go (``WeightPusher._memory_for``)."""

    transport: Transport
    segment: Segment | None = None
    """``shm``: the pusher's segment."""
    pin: Callable[[Segment], None] | None = None
    """``shm``: pins the segment for asynchronous copies from a GPU."""
    staging: torch.Tensor | None = None
    """``cuda_ipc``: the staging buffer (None: each tensor exported in place)."""
    staging_handle: ByteBufferHandle | None = None
    """``cuda_ipc``: the staging buffer's export, named in begin."""
    setup_s: float = 0.0
    """Allocating and exporting the staging buffer (part of the push's fill time)."""


class PushRun:
    """One push's placing of tensors: copies them where ``memory`` says and sends their
    placements, bucket by bucket (``send``: one ``/weights/update``).

    A bucket is sent once it holds ``bucket_bytes``; placements in memory the engine reads
    only after a synchronize (asynchronous copies into the segment, the staging buffer)
    are sent after it.
    """

    def __init__(self, memory: PushMemory, send: Callable[[list[TensorPlacement]], object],
                 bucket_bytes: int) -> None:
        self._memory = memory
        self._send = send
        self._bucket_bytes = bucket_bytes
        self._bucket: list[TensorPlacement] = []
        self._bucket_size = 0
        self._async_copies = False
        self._staged: list[TensorPlacement] = []
        self._exported: list[torch.Tensor] = []
        """``cuda_ipc`` in place: the engine maps these tensors' memory until finish
        returns; a handle does not keep its tensor alive, so this list does."""
        self.num_buckets = 0
        self.fill_s = memory.setup_s

    def place(self, tensor: torch.Tensor, spec: messages.ParamSpec, offset: int) -> None:
        """Put ``tensor`` (announced as ``spec``) in place at ``offset`` and announce it."""
        start = time.perf_counter()
        memory, name = self._memory, spec.name
        location: ShmLocation | CudaIpcLocation
        if memory.segment is not None:
            if tensor.device.type == "cuda":
                assert memory.pin is not None
                memory.pin(memory.segment)
                self._async_copies = True
            copy_into(memory.segment, offset, tensor, spec_nbytes(spec))
            location = ShmLocation(segment=memory.segment.name, offset=offset)
        elif memory.staging is not None:
            view_in(memory.staging, offset, spec.shape, spec.dtype).copy_(
                shareable(tensor, name))
            location = CudaIpcLocation(offset=offset)
        else:
            self._exported.append(shareable(tensor, name))
            location = CudaIpcLocation(handle=export_handle(self._exported[-1], name))
        self.fill_s += time.perf_counter() - start
        placement = TensorPlacement(name=name, dtype=spec.dtype, shape=tuple(spec.shape),
                                    location=location)
        if memory.staging_handle is not None:
            self._staged.append(placement)  # announced once every copy is done
        else:
            self._announce(placement)

    def finish_placing(self) -> None:
        """Announce what is left: the staged tensors, once their copies are done (the
        export's event was recorded before them, and a receiver that still maps the
        buffer from the last push reuses that mapping without waiting on any event:
        torch's ``rebuild_cuda_tensor``, storage cache hit), and the last bucket."""
        if self._staged:
            assert self._memory.staging is not None
            start = time.perf_counter()
            torch.cuda.synchronize(self._memory.staging.device)
            self.fill_s += time.perf_counter() - start
            for placement in self._staged:
                self._announce(placement)
        self._flush()

    def release(self) -> None:
        """Let go of the tensors exported in place (``cuda_ipc``, unstaged)."""
        if self._exported:
            self._exported.clear()
            torch.cuda.ipc_collect()  # frees copies the engine has let go of

    def _announce(self, placement: TensorPlacement) -> None:
        self._bucket.append(placement)
        self._bucket_size += placement.nbytes
        if self._bucket_size >= self._bucket_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self._bucket:
            return
        if self._async_copies:  # the bytes must be in the segment when announced
            self.fill_s += _synchronize()
        self._send(self._bucket)
        self.num_buckets += 1
        self._bucket, self._bucket_size = [], 0
