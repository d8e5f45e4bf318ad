"""The ``nccl`` transport's collective group: one broadcast from the trainer to every
engine worker per push.

Three processes use this module:

- the service process hosts the rendezvous (:class:`Rendezvous`, a torch ``TCPStore``)
  and hands its address out in ``POST /weights/group`` (a
  :class:`~rollout_service.protocol.messages.WeightGroupResponse`);
- the trainer (``WeightPusher(transport="nccl")``) joins as rank 0 with :func:`join`
  and, once a push's ``finish`` is sent and every worker is receiving, broadcasts one
  byte buffer holding every tensor at the offsets its placements name
  (:class:`~rollout_service.protocol.placement.BroadcastLocation`);
- each engine worker joins as rank ``1 + its rank``, counts itself in the store as
  receiving that push, receives the buffer, and counts itself as finished (received or
  failed), which is what the service waits on (:meth:`Rendezvous.finished`).

The group is torch.distributed's own process group, built directly on the store (no
default group, so the engine's own ``torch.distributed`` world is untouched): NCCL when
the engine runs on CUDA, gloo on the CPU. Both take the same calls, which is how the CPU
CI exercises the whole protocol. A rank that waits longer than the group's timeout for
the others (a trainer that died mid-broadcast) gets an error; the group is then
unusable and a new one is made for the next push.

torch is imported lazily: the service validates messages without it.
"""

from __future__ import annotations

import datetime
import uuid
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

Backend = Literal["nccl", "gloo"]
TRAINER_RANK = 0
"""The broadcast's source."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupSpec:
    """Where and how every rank joins one group (the wire form is
    ``WeightGroupResponse``, which carries the same fields)."""

    group_id: str
    master_address: str
    master_port: int
    world_size: int
    backend: Backend
    timeout_s: float

    def as_dict(self) -> dict[str, Any]:
        """JSON-safe, for vLLM's worker RPC."""
        return asdict(self)


def new_group_id() -> str:
    return f"rollout-{uuid.uuid4().hex[:16]}"


class Rendezvous:
    """The store every rank of the service's groups meets at (service process).

    One server for the service's lifetime, on a free port; each group uses its own key
    prefix, so an abandoned group's keys never meet a new one's.
    """

    def __init__(self, address: str, timeout_s: float) -> None:
        import torch.distributed as dist

        self.address = address
        self._store = dist.TCPStore(address, 0, None, True,
                                    datetime.timedelta(seconds=timeout_s),
                                    wait_for_workers=False)

    @property
    def port(self) -> int:
        return int(self._store.port)

    def finished(self, group_id: str, key: str) -> int:
        """How many workers of ``group_id`` have finished receiving broadcast ``key``
        (received it or failed): the service's wait reads this counter in its own store,
        not the workers' state through the engine. Why: vLLM's workers spin on their
        message queue for a second after every engine RPC (``SpinCondition`` in
        ``vllm/distributed/device_communicators/shm_broadcast.py``), so asking them every
        few milliseconds kept every worker busy-waiting through the broadcast and, on a
        2-core machine, starved the trainer that had to send it."""
        import torch.distributed as dist

        return int(dist.PrefixStore(group_id, self._store).add(_finished(key), 0))


class Group:
    """One rank's membership: the trainer sends each push (:meth:`send`), the workers
    receive it (:meth:`receive`); :meth:`broadcast` is the plain collective (the join's
    probe)."""

    def __init__(self, spec: GroupSpec, rank: int, process_group: Any, store: Any) -> None:
        self.spec = spec
        self.rank = rank
        self._pg = process_group
        self._store = store

    def broadcast(self, buffer: torch.Tensor) -> None:
        """Send ``buffer`` from the trainer to every rank, or receive into it; blocks until
        done (on CUDA, until the copy is queued on NCCL's stream and waited for).

        Raises:
            RuntimeError: another rank did not take part within the group's timeout.
        """
        self._wait(self._start(buffer), buffer)

    def receive(self, buffer: torch.Tensor, key: str) -> None:
        """A worker's part of the broadcast ``key`` (a push id): queue the receive into
        ``buffer``, then tell the trainer (:meth:`send` waits for every worker), then
        wait for the bytes.

        Raises:
            RuntimeError: the trainer did not send within the group's timeout.
        """
        work = self._start(buffer)
        if self._store.add(_receiving(key), 1) == self.spec.world_size - 1:
            self._store.set(_all_receiving(key), b"1")  # the last one wakes the trainer
        try:
            self._wait(work, buffer)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc} (queued and counted as receiving; "
                               f"{self._store.add(_receiving(key), 0)} of "
                               f"{self.spec.world_size - 1} counted)") from exc
        finally:
            self._count_finished(key)

    def _count_finished(self, key: str) -> None:
        """Tell the service this worker's receive of ``key`` ended, whichever way."""
        try:
            self._store.add(_finished(key), 1)
        except RuntimeError:  # the store gone: the service's own deadline ends its wait
            pass

    def send(self, buffer: torch.Tensor, key: str) -> None:
        """The trainer's part of the broadcast ``key``: once every worker is receiving,
        send ``buffer``.

        Why wait: the trainer queues its side of the collective (on CUDA, an NCCL kernel
        on its GPU) only once every worker can take it, so a worker that never starts
        receiving fails the push at the group's timeout with a Python error that says
        how many did, instead of leaving a collective waiting on the trainer's GPU.

        Raises:
            RuntimeError: not every worker started receiving, or they did not take part,
                within the group's timeout.
        """
        try:
            self._store.wait([_all_receiving(key)],
                             datetime.timedelta(seconds=self.spec.timeout_s))
        except RuntimeError as exc:  # torch's DistStoreError is one
            ready = self._store.add(_receiving(key), 0)
            raise RuntimeError(f"broadcast {key}: {ready} of {self.spec.world_size - 1} "
                               f"workers started receiving within {self.spec.timeout_s:g} s"
                               ) from exc
        self._wait(self._start(buffer), buffer)

    def _start(self, buffer: torch.Tensor) -> Any:
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = TRAINER_RANK
        return self._pg.broadcast([buffer], options)

    def _wait(self, work: Any, buffer: torch.Tensor) -> None:
        work.wait(datetime.timedelta(seconds=self.spec.timeout_s))
        if buffer.device.type == "cuda":
            import torch

            torch.cuda.current_stream(buffer.device).synchronize()

    def close(self) -> None:
        """Let go of the process group (NCCL's communicator is aborted, not waited on)."""
        abort = getattr(self._pg, "abort", None)
        if self.spec.backend == "nccl" and callable(abort):
            abort()
        self._pg = None


def _receiving(key: str) -> str:
    """The store counter of the workers receiving broadcast ``key``."""
    return f"receiving/{key}"


def _finished(key: str) -> str:
    """The store counter of the workers whose receive of broadcast ``key`` ended."""
    return f"finished/{key}"


def _all_receiving(key: str) -> str:
    """The store key the last worker to receive broadcast ``key`` sets; the trainer
    waits on it (a blocking wait in the store, no polling)."""
    return f"all-receiving/{key}"


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
    store = dist.PrefixStore(spec.group_id, dist.TCPStore(
        spec.master_address, spec.master_port, None, False, timeout))
    if spec.backend == "gloo":
        pg = dist.ProcessGroupGloo(store, rank, spec.world_size, timeout)
    else:
        assert device is not None and device.type == "cuda", device
        torch.cuda.set_device(device)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, spec.world_size, options)
    # A first collective, so that joining means every rank is reachable (NCCL connects
    # lazily otherwise) and a late rank fails the join, not the first push.
    probe = torch.zeros(1, dtype=torch.uint8,
                        device=device if spec.backend == "nccl" else "cpu")
    group = Group(spec, rank, pg, store)
    group.broadcast(probe)
    return group
