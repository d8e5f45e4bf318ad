"""The trainer's side of one ``nccl`` push: its tensors as one byte stream, cut into
buckets of the group's size, each broadcast while its ``/weights/update`` runs.

Runs in the trainer process (``WeightPusher.push`` with ``transport="nccl"``). The stream
has the layout of the ``shm`` segment (every tensor at a 64-byte aligned offset,
``push.layout``); a bucket is the next ``bucket_bytes`` of it (the last one shorter), so a
tensor larger than a bucket simply spans several. The trainer holds one bucket buffer on
its device (the GPU for NCCL), never the whole model: each tensor's bytes are copied into
it as they come, a full bucket is checksummed and broadcast, and the buffer is reused
(the broadcast has finished when its update call returns). Each update announces the
tensors whose last byte is in its bucket, so the service checks every placement against
bytes that have arrived.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from rollout_service.protocol import messages
from rollout_service.protocol.broadcast import bucket_checksum, checksum_hex
from rollout_service.protocol.placement import BroadcastLocation, TensorPlacement
from rollout_service.protocol.store import BucketInfo
from trainer_client.group import TrainerGroup


class BucketStream:
    """One push's stream (module docstring).

    Args:
        group: the trainer's group (joined).
        push_id: the push, from its begin.
        total_bytes: the stream's length (``push.layout``'s end; a multiple of 64).
        send: one ``/weights/update`` call.
    """

    def __init__(self, group: TrainerGroup, push_id: str, total_bytes: int,
                 send: Callable[[messages.PushUpdateRequest], object]) -> None:
        self._group = group
        self._push_id = push_id
        self._total = total_bytes
        self._send = send
        self._bucket_bytes = group.bucket_bytes
        self._buffer = torch.zeros(min(self._bucket_bytes, total_bytes), dtype=torch.uint8,
                                   device=group.device)
        self._start = 0
        """Where the bucket being filled starts in the stream."""
        self._pending: list[TensorPlacement] = []
        self.num_buckets = 0
        self.fill_s = 0.0
        """Copying tensors into the bucket buffer and checksumming it."""
        self.broadcast_s = 0.0
        """Update calls with their broadcasts."""

    def place(self, tensor: torch.Tensor, spec: messages.ParamSpec, offset: int) -> None:
        """Copy ``tensor`` (announced as ``spec``) to ``offset`` of the stream, sending
        every bucket it fills."""
        start = time.perf_counter()
        data = tensor.detach().to(self._buffer.device).contiguous().view(-1).view(torch.uint8)
        self._pending.append(TensorPlacement(name=spec.name, dtype=spec.dtype,
                                             shape=tuple(spec.shape),
                                             location=BroadcastLocation(offset=offset)))
        position, end = offset, offset + data.numel()
        while position < end:
            if position >= self._start + self._bucket_bytes:
                self.fill_s += time.perf_counter() - start
                self._flush(self._bucket_bytes)
                start = time.perf_counter()
            stop = min(end, self._start + self._bucket_bytes)
            self._buffer[position - self._start:stop - self._start].copy_(
                data[position - offset:stop - offset])
            position = stop
        self.fill_s += time.perf_counter() - start

    def finish_placing(self) -> None:
        """Send what is left (the last bucket ends at the stream's end)."""
        while self._start < self._total:
            self._flush(min(self._bucket_bytes, self._total - self._start))

    def release(self) -> None:
        """Let the bucket buffer go."""
        self._buffer = self._buffer[:0]

    def _flush(self, nbytes: int) -> None:
        start = time.perf_counter()
        payload = self._buffer[:nbytes]
        checksum = bucket_checksum(payload)
        self.fill_s += time.perf_counter() - start
        end = self._start + nbytes
        ready = [p for p in self._pending if p.location.offset + p.nbytes <= end]
        self._pending = [p for p in self._pending if p.location.offset + p.nbytes > end]
        bucket = BucketInfo(index=self.num_buckets, offset=self._start, nbytes=nbytes,
                            checksum=checksum_hex(checksum))
        request = messages.PushUpdateRequest(push_id=self._push_id, tensors=ready,
                                             bucket=bucket)
        start = time.perf_counter()
        self._group.during_update(f"{self._push_id}/{bucket.index}", payload,
                                  index=bucket.index, checksum=checksum,
                                  update=lambda: self._send(request))
        self.broadcast_s += time.perf_counter() - start
        self.num_buckets += 1
        self._start = end
        self._buffer.zero_()  # the padding between tensors is part of the checksum
