"""The ``nccl`` transport's collective group: the trainer broadcasts each bucket of a push
to every engine worker of every server (or Ray Serve replica) at once.

Three kinds of process use this module:

- the trainer owns the group: it hosts the rendezvous (:class:`Rendezvous`, a torch
  ``TCPStore``), tells each server where it is, how large the world is and at which rank
  that server's workers start (``POST /weights/group``: ``rank_offset``), joins as rank
  0 (:func:`join`) and, during each ``/weights/update`` call, sends one bucket
  (:meth:`Group.send_bucket`);
- each engine worker joins as ``rank_offset + its own rank`` and receives each bucket
  into a slot of a fixed-size ring (:meth:`Group.receive_bucket`), counting itself in
  the store when it is ready to receive and when its receive ended;
- the service process reads those counters in the same store (:class:`StoreCounters`),
  so it knows when its own workers are done without asking them (vLLM's workers spin
  for a second after every RPC; asking every few milliseconds starved the trainer of a
  2-core machine).

A bucket travels as two collectives: a fixed 32-byte header (:class:`FrameHeader`:
length, checksum, index) then the payload. A receiver checks the header against what
the update call announced before it posts the payload's receive, so a trainer that
sends more bytes than announced is refused instead of overrunning the slot: gloo
aborts the process on a receive shorter than the message (``pair.cc``: "Received data
size doesn't match expected size"), NCCL's behaviour on mismatched counts is undefined.
A trainer that sends fewer bytes than its header says leaves stale bytes in the slot's
tail, which gloo reports as success; the checksum catches it.

The group is torch.distributed's own process group built directly on the store (no
default group, so the engine's own world is untouched): NCCL on CUDA, gloo on the CPU,
the same calls. A rank that waits longer than the group's timeout for the others (a
trainer that died or stalls) gets an error; the group is then unusable and is closed.

torch is imported lazily: the service validates messages without it.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

from rollout_service.protocol.group_store import (
    Rendezvous,
    StoreCounters,
    all_receiving_key,
    finished_key,
    group_store,
    receiving_key,
)
from rollout_service.protocol.store import bucket_checksum, checksum_hex

if TYPE_CHECKING:
    import torch

__all__ = ["Backend", "BucketRefused", "FrameHeader", "Group", "GroupSpec", "Rendezvous",
           "Rendezvous_Style", "StoreCounters", "bucket_checksum", "checksum_hex",
           "group_store", "join"]

Backend = Literal["nccl", "gloo"]
Rendezvous_Style = Literal["rollout", "torch", "vllm"]
TRAINER_RANK = 0
"""The broadcast's source."""
HEADER_MAGIC = 0x524F4C4C4F555431  # "ROLLOUT1"
"""First word of every bucket's header: a trainer speaking another framing is refused."""
HEADER_WORDS = 4
"""magic, nbytes, checksum, index: int64 each."""
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupSpec:
    """Where and how the ranks of one server (or replica) join the trainer's group."""

    group_id: str
    """The group's name; its keys live under this prefix of the trainer's store."""
    master_address: str
    master_port: int
    world_size: int
    """The trainer and every receiver of every server."""
    rank_offset: int
    """This server's first rank; its worker ``i`` joins as ``rank_offset + i``."""
    backend: Backend
    timeout_s: float
    """How long a rank waits for the others in the join and in each collective."""
    style: Rendezvous_Style = "rollout"
    """How the ranks meet in the store (:func:`group_store`): ``rollout``, this project's
    trainer; ``torch``, a trainer's torch.distributed group made the way SGLang's
    ``init_custom_process_group`` makes it (slime, AReaL); ``vllm``, vLLM's
    ``StatelessProcessGroup`` and PyNccl (``vllm_rendezvous.py``)."""

    def as_dict(self) -> dict[str, Any]:
        """JSON-safe, for vLLM's worker RPC."""
        return asdict(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class FrameHeader:
    """What precedes every bucket's payload in the group (and what the update call
    announced for it): the receiver compares the two before it receives the payload."""

    nbytes: int
    checksum: int
    """:func:`bucket_checksum` of the payload, an unsigned 64-bit integer."""
    index: int
    """The bucket's position in its push (0, 1, ...)."""


class Group:
    """One rank's membership: the trainer sends buckets (:meth:`send_bucket`), the workers
    receive them (:meth:`receive_bucket`); :meth:`broadcast` is the plain collective."""

    def __init__(self, spec: GroupSpec, rank: int, process_group: Any, store: Any) -> None:
        self.spec = spec
        self.rank = rank
        self._pg = process_group
        self._store = store

    def broadcast(self, buffer: torch.Tensor) -> None:
        """Send ``buffer`` from the trainer to every rank, or receive into it; blocks until
        done.

        Raises:
            RuntimeError: another rank did not take part within the group's timeout, or
                left the group.
        """
        self._wait(self._start(buffer), buffer)

    def receive_bucket(self, slot: torch.Tensor, key: str, announced: FrameHeader
                       ) -> torch.Tensor:
        """A worker's part of bucket ``key``: count itself as receiving (the last one tells
        the trainer to send), take the header, check it against ``announced``, then take
        the payload into ``slot`` and check its checksum. Returns the payload (a view of
        ``slot``).

        Raises:
            BucketRefused: the header or the checksum is not what was announced (the
                payload was received and is dropped, or, when it is longer than the
                slot, not received at all: the caller must then leave the group).
            RuntimeError: the trainer did not send within the group's timeout, or left.
        """
        import torch

        try:
            header = torch.zeros(HEADER_WORDS, dtype=torch.int64, device=slot.device)
            work = self._start(header)
            if self._store.add(receiving_key(key), 1) == self.spec.world_size - 1:
                self._store.set(all_receiving_key(key), b"1")  # the last one wakes the trainer
            self._wait(work, header)
            magic, nbytes, checksum, index = (int(v) for v in header.tolist())
            if magic != HEADER_MAGIC:
                raise BucketRefused(f"bucket {key}: header {magic:#x} is not this "
                                    "transport's framing", must_leave=True)
            if nbytes > slot.numel() or nbytes <= 0:
                raise BucketRefused(f"bucket {key}: the trainer sends {nbytes} bytes, more "
                                    f"than the {slot.numel()}-byte slot (announced "
                                    f"{announced.nbytes}); not received", must_leave=True)
            payload = slot[:nbytes]
            self._wait(self._start(payload), payload)
            sent = FrameHeader(nbytes=nbytes, checksum=checksum & _MASK64, index=index)
            if sent != announced:
                raise BucketRefused(f"bucket {key}: the trainer sent {_describe(sent)}, "
                                    f"the update announced {_describe(announced)}")
            actual = bucket_checksum(payload)
            if actual != announced.checksum:
                raise BucketRefused(f"bucket {key}: received bytes have checksum "
                                    f"{checksum_hex(actual)}, announced "
                                    f"{checksum_hex(announced.checksum)} (a broadcast "
                                    "shorter than announced, or corrupted)")
            return payload
        finally:
            self._count_finished(key)

    def receive_raw(self, slot: torch.Tensor, key: str, nbytes: int) -> torch.Tensor:
        """A worker's part of a bucket in the frameworks' framing: one collective of
        exactly ``nbytes``, no header and no checksum (vLLM's packed chunks, SGLang's
        one broadcast per tensor); counted in the store as :meth:`receive_bucket` counts.
        Nothing can check its length: a trainer that sends more aborts a gloo receiver
        (the reason this project's own framing has a header).

        Raises:
            RuntimeError: the trainer did not send within the group's timeout, or left.
        """
        try:
            payload = slot[:nbytes]
            work = self._start(payload)
            if self._store.add(receiving_key(key), 1) == self.spec.world_size - 1:
                self._store.set(all_receiving_key(key), b"1")
            self._wait(work, payload)
            return payload
        finally:
            self._count_finished(key)

    def _count_finished(self, key: str) -> None:
        """Tell this server's service that this worker's receive of ``key`` ended."""
        try:
            self._store.add(finished_key(key, self.spec.rank_offset), 1)
        except RuntimeError:  # the store gone: the service's own deadline ends its wait
            pass

    def send_bucket(self, payload: torch.Tensor, key: str, *, index: int, checksum: int,
                    is_cancelled: Callable[[], bool] = lambda: False) -> None:
        """The trainer's part of bucket ``key``: once every worker is receiving it, send
        its header, then its bytes.

        Why wait: the trainer queues its side of the collective (on CUDA, an NCCL kernel
        on its GPU) only once every worker can take it, so a worker that never starts
        receiving fails the bucket at the group's timeout with a Python error that says
        how many did, instead of leaving a collective waiting on the trainer's GPU.
        ``is_cancelled`` ends the wait early (the service refused the update: no worker
        will receive).

        Raises:
            RuntimeError: not every worker started receiving within the group's timeout
                (or the wait was cancelled), or a rank left during the broadcast.
        """
        import torch

        self._wait_ready(key, is_cancelled)
        header = torch.tensor([HEADER_MAGIC, payload.numel(), _signed(checksum), index],
                              dtype=torch.int64, device=payload.device)
        self._wait(self._start(header), header)
        self._wait(self._start(payload), payload)

    def _wait_ready(self, key: str, is_cancelled: Callable[[], bool]) -> None:
        """Wait in the store for the last worker's key, in short steps so that a refused
        update (``is_cancelled``) ends the wait."""
        deadline = time.monotonic() + self.spec.timeout_s
        while True:
            step = min(0.2, max(deadline - time.monotonic(), 0.001))
            try:
                self._store.wait([all_receiving_key(key)], datetime.timedelta(seconds=step))
                return
            except RuntimeError as exc:  # torch's DistStoreError is one
                if is_cancelled() or time.monotonic() >= deadline:
                    ready = self._store.add(receiving_key(key), 0)
                    why = "the update was refused" if is_cancelled() else (
                        f"within {self.spec.timeout_s:g} s")
                    raise RuntimeError(f"bucket {key}: {ready} of {self.spec.world_size - 1} "
                                       f"workers started receiving ({why})") from exc

    def _start(self, buffer: torch.Tensor) -> Any:
        import torch.distributed as dist

        if self._pg is None:
            raise RuntimeError(f"group {self.spec.group_id} is closed")
        options = dist.BroadcastOptions()
        options.rootRank = TRAINER_RANK
        return self._pg.broadcast([buffer], options)

    def _wait(self, work: Any, buffer: torch.Tensor) -> None:
        work.wait(datetime.timedelta(seconds=self.spec.timeout_s))
        if buffer.device.type == "cuda":
            import torch

            torch.cuda.current_stream(buffer.device).synchronize()

    def close(self) -> None:
        """Leave the group: NCCL's communicator is aborted, not waited on; gloo's sockets
        close, so a trainer still sending gets an error instead of waiting."""
        pg, self._pg = self._pg, None
        if pg is None:
            return
        stop = getattr(pg, "abort", None) if self.spec.backend == "nccl" else getattr(
            pg, "shutdown", None)
        if callable(stop):
            try:
                stop()
            except RuntimeError:  # already broken: nothing left to stop
                pass


class BucketRefused(Exception):
    """A bucket whose header or bytes are not what its update announced.

    ``must_leave``: its payload was not received (longer than the slot, or another
    framing), so this rank's next collective would not match the trainer's: it must
    leave the group."""

    def __init__(self, message: str, *, must_leave: bool = False) -> None:
        super().__init__(message)
        self.must_leave = must_leave


def _describe(header: FrameHeader) -> str:
    return (f"bucket {header.index} of {header.nbytes} bytes, checksum "
            f"{checksum_hex(header.checksum)}")


def _signed(value: int) -> int:
    """An unsigned 64-bit value as the int64 a tensor holds."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


NCCL_ERROR_HANDLING = "2"
"""``TORCH_NCCL_ASYNC_ERROR_HANDLING`` for this transport's NCCL groups: ``CleanUpOnly``,
so that a collective that times out or loses a rank (a trainer that died mid-broadcast)
has its communicator aborted and its ``wait`` raise, and the process lives on. torch's
default, ``SkipCleanUp`` (3), or ``TearDown`` (1) end the whole process, which here is a
vLLM worker: the engine would die with the trainer. Not run in CI (no two GPUs)."""


@contextmanager
def _nccl_errors_raise() -> Iterator[None]:
    """The process group made inside reads :data:`NCCL_ERROR_HANDLING` (torch reads the
    variable when it builds a ``ProcessGroupNCCL``); the process's other groups, the
    engine's own, keep theirs."""
    name = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    previous = os.environ.get(name)
    os.environ[name] = NCCL_ERROR_HANDLING
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def join(spec: GroupSpec, rank: int, device: torch.device | None = None) -> Group:
    """Join ``spec``'s group as ``rank``; blocks until every rank has joined.

    Args:
        device: the CUDA device of this rank's buffers (``nccl`` only).

    Raises:
        RuntimeError: the other ranks did not join within the group's timeout.
    """
    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=spec.timeout_s)
    if spec.style == "vllm":
        from rollout_service.protocol import vllm_rendezvous

        if spec.backend == "gloo":
            pg, base = vllm_rendezvous.join_stand_in(spec, rank)
        else:
            assert device is not None and device.type == "cuda", device
            torch.cuda.set_device(device)
            pg, base = vllm_rendezvous.join_pynccl(spec, rank, device)
        return Group(spec, rank, pg, vllm_rendezvous.counters_store(base))
    store = group_store(spec, is_rank=True)
    if spec.backend == "gloo":
        pg = dist.ProcessGroupGloo(store, rank, spec.world_size, timeout)
    else:
        assert device is not None and device.type == "cuda", device
        torch.cuda.set_device(device)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        with _nccl_errors_raise():
            pg = dist.ProcessGroupNCCL(store, rank, spec.world_size, options)
    group = Group(spec, rank, pg, store)
    if spec.style == "rollout":
        # A first collective, so that joining means every rank is reachable (NCCL
        # connects lazily otherwise) and a late rank fails the join, not the first push.
        # A ``torch``-style trainer sends none: its first collective is a tensor's.
        group.broadcast(torch.zeros(1, dtype=torch.uint8,
                                    device=device if spec.backend == "nccl" else "cpu"))
    return group
