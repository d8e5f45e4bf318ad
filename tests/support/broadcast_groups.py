"""Helpers for the ``nccl`` transport's unit tests (``tests/unit/rollout_service/
test_broadcast_{group,receive,intake,service_group}.py``): gloo groups joined from threads
of the test process, and bucket descriptions.

Every rank of a group is a thread of this process, meeting in the trainer's store (the
``rendezvous`` fixture of ``tests/unit/rollout_service/conftest.py``); group ids come
from one counter, so no two groups of a run share a store prefix.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from rollout_service.protocol.broadcast import Group, GroupSpec, Rendezvous, join
from rollout_service.protocol.store import BucketInfo

group_numbers = iter(range(10**6))
"""The next number for a group id (``spec``'s, and a test's own trainer groups)."""


def spec(rendezvous: Rendezvous, world_size: int, timeout_s: float = 10.0,
         rank_offset: int = 1) -> GroupSpec:
    return GroupSpec(group_id=f"g{next(group_numbers)}", master_address=rendezvous.address,
                     master_port=rendezvous.port, world_size=world_size,
                     rank_offset=rank_offset, backend="gloo", timeout_s=timeout_s)


def joined(group: GroupSpec) -> dict[int, Group]:
    """Every rank of ``group`` joined, each from a thread of its own."""
    members: dict[int, Group] = {}
    threads = [threading.Thread(target=lambda r=r: members.__setitem__(r, join(group, r)))
               for r in range(group.world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(members) == set(range(group.world_size))
    return members


def in_thread(target: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    """Run ``target`` on a thread; its result or exception lands in the list."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(target())
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def bucket(index: int, offset: int, nbytes: int) -> BucketInfo:
    return BucketInfo(index=index, offset=offset, nbytes=nbytes, checksum="0" * 16)
