"""The stores a ``nccl`` weight group meets in: the trainer's rendezvous, how the ranks
lay their keys out in it, and the counters the service reads there.

Used by the trainer (:class:`Rendezvous` hosts the store), the engine workers
(:func:`group_store` for their process group and their counts) and the service
(:class:`StoreCounters`: its own workers' counts, without asking them). torch is
imported lazily.
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollout_service.protocol.broadcast import GroupSpec


class Rendezvous:
    """The store every rank of the trainer's groups meets at (the trainer's process).

    One server for the trainer's lifetime, on a free port; each group uses its own key
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


class StoreCounters:
    """A service's read-only view of one group's counters in the trainer's store.

    The service waits here for its own workers' receives to end (each worker counts
    itself under its server's ``rank_offset``) instead of asking the workers.
    """

    def __init__(self, spec: GroupSpec) -> None:
        self._store = group_store(spec, is_rank=False)
        self._server = spec.rank_offset

    def finished(self, key: str) -> int:
        """How many of this server's workers have finished receiving ``key`` (received it
        or failed)."""
        return int(self._store.add(finished_key(key, self._server), 0))


def receiving_key(key: str) -> str:
    """The store counter of the workers (of every server) receiving bucket ``key``."""
    return f"receiving/{key}"


def finished_key(key: str, server: int) -> str:
    """The store counter of one server's workers whose receive of ``key`` ended."""
    return f"finished/{key}/{server}"


def all_receiving_key(key: str) -> str:
    """The store key the last worker to receive bucket ``key`` sets; the trainer waits on
    it (a blocking wait in the store)."""
    return f"all-receiving/{key}"


def group_store(spec: GroupSpec, *, is_rank: bool) -> Any:
    """The store a group's ranks use, as ``spec.style`` lays it out: ``rollout``, the
    trainer's store under ``group_id``; ``vllm``, vLLM's ``StatelessProcessGroup`` store
    with this service's counters under ``rollout/`` (``vllm_rendezvous.py``); ``torch``,
    the prefixes torch's own
    ``_new_process_group_helper`` adds to a custom group's store (``group_id``, then
    ``group_id/``, then the device: ``cpu/`` for gloo, ``cuda/`` for NCCL), a rank's
    client counting itself in the world (the trainer's store waits for that many
    clients), the service's not (``is_rank`` False)."""
    import torch.distributed as dist

    if spec.style == "vllm":
        from rollout_service.protocol import vllm_rendezvous

        return vllm_rendezvous.counters_store(vllm_rendezvous.stateless_store(
            spec, is_rank=is_rank))
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    world = spec.world_size if is_rank and spec.style == "torch" else None
    base = dist.TCPStore(spec.master_address, spec.master_port, world, False, timeout)
    if spec.style == "rollout":
        return dist.PrefixStore(spec.group_id, base)
    device = "cuda" if spec.backend == "nccl" else "cpu"
    return dist.PrefixStore(f"{device}/", dist.PrefixStore(
        f"{spec.group_id}/", dist.PrefixStore(spec.group_id, base)))
