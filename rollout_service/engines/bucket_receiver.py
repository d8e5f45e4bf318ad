"""One receiver's part of a ``nccl`` push: a ring of fixed-size slots, a thread that
takes the trainer's buckets in order, and one that writes them to the stored copy.

Runs in whichever process is a rank of the trainer's group (``group_member.py`` holds one
:class:`PushReceiver` per push): a vLLM worker (``engines/vllm/broadcast_backend.py``) or
the service process in front of SGLang (``engines/sglang/group_receiver.py``), on threads
of its own so that the engine keeps stepping while the trainer broadcasts. No engine
import: the unit tests drive it over gloo between threads.

Memory: a worker holds at most ``num_slots`` slots of ``slot_bytes`` (allocated on first
use, freed when the push's receive ends), never a buffer of the whole checkpoint. A
bucket's slot is taken when its receive starts and given back once the bucket is checked
and, on the server's writer (its first worker), written at its offset in the push's
stored copy (``protocol/store.py``: the push's byte stream at its own offsets); with two
slots the next bucket arrives while the
last one is written. Every worker checks every bucket's length and checksum; only the
writer stores it (all of a server's workers are on one host and load from that file).

Failures end the push on this worker and are reported through :meth:`PushReceiver.
bucket_state` and :meth:`PushReceiver.report`: a bucket that is not what its update
announced is ``refused`` (dropped; the group stays, unless its payload could not be
received, then this worker leaves the group), a broadcast that breaks (the trainer gone,
a stall past the group's timeout, another rank gone) is ``failed`` and the worker leaves
the group. Nothing here touches a parameter.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import torch

from rollout_service.engines.broadcast_engine import BucketReceive
from rollout_service.protocol.broadcast import BucketRefused, FrameHeader, Group
from rollout_service.protocol.store import BucketInfo, StoreWriter, checksum_hex, copy_checksum


class Ring:
    """``num_slots`` byte buffers of ``slot_bytes`` on ``device``, allocated on first use.

    :meth:`acquire` blocks while every slot is taken (the writer is behind): that is
    what bounds a worker's memory, whatever the push's size.
    """

    def __init__(self, slot_bytes: int, num_slots: int, device: torch.device) -> None:
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self._device = device
        self._free: list[torch.Tensor] = []
        self._num_allocated = 0
        self._available = threading.Condition()

    def acquire(self, timeout_s: float) -> torch.Tensor:
        """A free slot.

        Raises:
            RuntimeError: none came free within ``timeout_s``.
        """
        with self._available:
            if not self._available.wait_for(
                    lambda: self._free or self._num_allocated < self.num_slots, timeout_s):
                raise RuntimeError(f"no free ring slot within {timeout_s:g} s (the stored "
                                   "copy's writes are behind)")
            if self._free:
                return self._free.pop()
            self._num_allocated += 1
        return torch.empty(self.slot_bytes, dtype=torch.uint8, device=self._device)

    def release(self, slot: torch.Tensor) -> None:
        with self._available:
            self._free.append(slot)
            self._available.notify()

    @property
    def peak_bytes(self) -> int:
        """Bytes of every slot allocated so far (slots are kept until :meth:`close`)."""
        return self._num_allocated * self.slot_bytes

    def close(self) -> None:
        with self._available:
            self._free.clear()


@dataclass(kw_only=True, slots=True)
class _Spill:
    slot: torch.Tensor
    payload: torch.Tensor
    offset: int
    index: int
    is_raw: bool
    """A bucket of the frameworks' framing: no checksum came with it."""


_STOP = object()


class PushReceiver:
    """One push's buckets on one worker (module docstring).

    Args:
        group: the worker's membership of the trainer's group.
        receive: the push's receive settings (store path, ring geometry).
        device: where the ring lives (the worker's GPU for NCCL, the CPU for gloo).
        is_writer: whether this worker writes the stored copy.
    """

    def __init__(self, group: Group, receive: BucketReceive, *, device: torch.device,
                 is_writer: bool) -> None:
        self.push_id = receive.push_id
        self._group = group
        self._timeout_s = group.spec.timeout_s
        self._ring = Ring(receive.slot_bytes, receive.num_slots, device)
        self._writer = StoreWriter(receive.store_path) if is_writer else None
        self._staging: torch.Tensor | None = None
        self._buckets: list[BucketInfo] = []
        self._states: dict[int, str] = {}
        self._copy_checksums: dict[int, str] = {}
        self._failure: str | None = None
        self._lock = threading.Lock()
        self._orders: queue.Queue[object] = queue.Queue()
        self._spills: queue.Queue[object] = queue.Queue()
        self._receiver = threading.Thread(target=self._receive_loop, daemon=True,
                                          name=f"rollout-receive-{self.push_id[:8]}")
        self._spiller = threading.Thread(target=self._spill_loop, daemon=True,
                                         name=f"rollout-spill-{self.push_id[:8]}")
        self._receiver.start()
        self._spiller.start()

    # ---- what the service asks (through the backend's RPCs) ------------------------

    def start(self, bucket: BucketInfo) -> None:
        """Queue ``bucket``'s receive (the buckets of a push come in order)."""
        with self._lock:
            if bucket.index != len(self._buckets):
                raise RuntimeError(f"bucket {bucket.index} of push {self.push_id} out of "
                                   f"order: expected {len(self._buckets)}")
            self._buckets.append(bucket)
            self._states[bucket.index] = "running"
        self._orders.put(bucket)

    def bucket_state(self, index: int) -> str:
        """``running``, ``done`` (received and checked), ``refused: ...``, ``failed: ...``
        or ``unknown``."""
        with self._lock:
            state = self._states.get(index, "unknown")
        return "done" if state == "stored" else state

    def report(self, num_buckets: int) -> tuple[str, int]:
        """The whole receive's state after ``num_buckets`` buckets (``done`` once each is
        received, checked and stored) and the peak bytes of the ring."""
        with self._lock:
            if self._failure is not None:
                return self._failure, self._ring.peak_bytes
            states = [self._states.get(i, "unknown") for i in range(num_buckets)]
        bad = next((s for s in states if s not in ("running", "done", "stored")), None)
        if bad is not None:
            return bad, self._ring.peak_bytes
        is_done = all(s == "stored" for s in states) if self._writer else all(
            s == "done" for s in states)
        return ("done" if is_done else "running"), self._ring.peak_bytes

    def copy_checksums(self) -> dict[int, str]:
        """The writer's checksums of the buckets that came without one (by index):
        :func:`~rollout_service.protocol.store.copy_checksum` of the bytes as they
        arrived, so that a peer's copy of them can be checked later; empty on the other
        workers."""
        with self._lock:
            return dict(self._copy_checksums)

    def close(self) -> None:
        """Stop both threads (after what is queued) and let the ring and the file go."""
        self._orders.put(_STOP)
        self._receiver.join(self._timeout_s + 5)
        self._spills.put(_STOP)
        self._spiller.join(self._timeout_s + 5)
        self._ring.close()
        self._staging = None
        if self._writer is not None:
            self._writer.close()

    # ---- the two threads -----------------------------------------------------------

    def _receive_loop(self) -> None:
        while (order := self._orders.get()) is not _STOP:
            assert isinstance(order, BucketInfo)
            if self._failure is not None:
                self._set(order.index, self._failure)
                continue
            self._receive_one(order)

    def _receive_one(self, bucket: BucketInfo) -> None:
        announced = None if bucket.checksum is None else FrameHeader(
            nbytes=bucket.nbytes, checksum=bucket.checksum_value, index=bucket.index)
        key = f"{self.push_id}/{bucket.index}"
        if bucket.nbytes > self._ring.slot_bytes:  # a raw bucket's length is the update's
            self._group.close()  # its broadcast comes anyway: no receive may match it
            self._fail(bucket.index, f"refused, left the group: bucket {bucket.index} of "
                                     f"{bucket.nbytes} bytes is larger than the "
                                     f"{self._ring.slot_bytes}-byte slot")
            return
        try:
            slot = self._ring.acquire(self._timeout_s)
        except RuntimeError as exc:
            self._fail(bucket.index, f"failed: {exc}")
            return
        try:
            payload = (self._group.receive_raw(slot, key, bucket.nbytes)
                       if announced is None else
                       self._group.receive_bucket(slot, key, announced))
        except BucketRefused as exc:
            self._ring.release(slot)
            if exc.must_leave:
                self._group.close()
                self._fail(bucket.index, f"refused, left the group: {exc}")
            else:
                self._fail(bucket.index, f"refused: {exc}")
            return
        except Exception as exc:  # the broadcast broke: this rank's group is unusable
            self._ring.release(slot)
            self._group.close()
            self._fail(bucket.index, f"failed: {exc!r}")
            return
        self._set(bucket.index, "done")
        if self._writer is None:
            self._ring.release(slot)
        else:
            self._spills.put(_Spill(slot=slot, payload=payload, offset=bucket.offset,
                                    index=bucket.index, is_raw=announced is None))

    def _spill_loop(self) -> None:
        while (spill := self._spills.get()) is not _STOP:
            assert isinstance(spill, _Spill) and self._writer is not None
            try:
                if spill.is_raw:  # on the slot's own device, before it is copied out
                    checksum = checksum_hex(copy_checksum(spill.payload))
                    with self._lock:
                        self._copy_checksums[spill.index] = checksum
                self._writer.write(spill.offset, memoryview(self._host(spill.payload)))
            except Exception as exc:  # a full disk fails the push, nothing is loaded
                self._fail(spill.index, f"failed: writing the stored copy: {exc!r}")
            else:
                self._set(spill.index, "stored")
            finally:
                self._ring.release(spill.slot)

    def _host(self, payload: torch.Tensor) -> object:
        """The payload's bytes in host memory (a CUDA slot goes through one pinned
        staging buffer, reused)."""
        if payload.device.type == "cpu":
            return payload.numpy()
        if self._staging is None:
            self._staging = torch.empty(self._ring.slot_bytes, dtype=torch.uint8,
                                        pin_memory=True)
        host = self._staging[:payload.numel()]
        host.copy_(payload)
        return host.numpy()

    def _set(self, index: int, state: str) -> None:
        with self._lock:
            if not self._states.get(index, "").startswith(("refused", "failed")):
                self._states[index] = state

    def _fail(self, index: int, state: str) -> None:
        with self._lock:
            self._states[index] = state
            if self._failure is None:
                self._failure = state
