"""The contract of an engine whose workers take pushes as broadcasts in the trainer's
collective group (``weights_transport: nccl``): joining and leaving the group, receiving
each bucket into a bounded ring, and the receive reports the push manager checks before
anything loads (``weights/group.py`` drives it; vLLM: ``engines/vllm/broadcast_backend.py``;
SGLang: ``engines/sglang/group_receiver.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from rollout_service.protocol.broadcast import Backend, GroupSpec
from rollout_service.protocol.store import BucketInfo


@dataclass(frozen=True, kw_only=True, slots=True)
class BucketReceive:
    """How a server's workers receive the buckets of one ``nccl`` push."""

    push_id: str
    store_path: str
    """The push's stored copy on this server, written by its first worker."""
    slot_bytes: int
    """Each ring slot's size: the group's largest bucket."""
    num_slots: int
    """Ring slots per worker."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerReceive:
    """One worker's part of a push's receive, as it reports it."""

    state: str
    """``running``, ``done`` (every bucket received, checked and, by the writer, stored),
    ``refused: ...`` (a bucket was not what its update announced), ``failed: ...``
    (the broadcast broke: the worker left the group) or ``unknown``."""
    peak_bytes: int
    """The most bytes the worker held in receive buffers at once during the push."""
    copy_checksums: dict[int, str] = field(default_factory=dict)
    """The server's writer: the checksum of each bucket that came without one, by index,
    as it arrived (``protocol.store.copy_checksum``); empty on the other workers."""


@runtime_checkable
class BroadcastEngine(Protocol):
    """An engine whose workers take pushes as broadcasts in the trainer's collective
    group (``weights_transport: nccl``; vLLM: ``engines/vllm/broadcast_backend.py``)."""

    @property
    def num_workers(self) -> int:
        """Worker processes that join a group (ranks rank_offset..+num_workers-1)."""
        ...

    @property
    def group_backends(self) -> tuple[Backend, ...]:
        """The backends the workers can join a group on, the one a group gets when its
        trainer names none first: ``nccl`` for workers on CUDA, ``gloo`` on the CPU."""
        ...

    async def join_group(self, spec: GroupSpec) -> None:
        """Have every worker start joining ``spec``'s group at ``spec.rank_offset`` plus
        its rank, leaving any earlier group; returns at once (the trainer joins
        meanwhile; :meth:`group_state` follows the join)."""
        ...

    async def group_state(self, group_id: str) -> list[str]:
        """Each worker's join: ``running``, ``done``, ``failed: ...`` or ``unknown``."""
        ...

    async def leave_group(self) -> None:
        """Every worker leaves its group (a trainer still sending gets an error)."""
        ...

    async def start_bucket(self, receive: BucketReceive, bucket: BucketInfo) -> None:
        """Have every worker start receiving ``bucket`` into its ring, the first worker
        then writing it into the stored copy (no parameter changes); returns at once."""
        ...

    async def bucket_states(self, push_id: str, index: int) -> list[str]:
        """Each worker's receive of one bucket (the states of :class:`WorkerReceive`;
        ``done`` means received and checked)."""
        ...

    async def receive_reports(self, push_id: str, num_buckets: int) -> list[WorkerReceive]:
        """Each worker's receive of the push's first ``num_buckets`` buckets; a worker
        whose receive ended (``done``: every bucket stored; or a failure) lets its ring
        go."""
        ...
