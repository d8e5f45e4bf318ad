"""The trainer's side of the ``nccl`` transport: the group it owns, and each bucket's
broadcast during its update call.

Runs in the trainer process, inside ``WeightPusher(transport="nccl")``. The trainer hosts
the rendezvous (a torch ``TCPStore`` on a free port of its host) and is rank 0, as in the
frameworks (vLLM's ``NCCLTrainerWeightTransferEngine``, vllm-project/vllm
``vllm/distributed/weight_transfer/nccl_engine.py``; SkyRL's
``weight_sync/control_plane.py``): its first push asks the service how many ranks it
takes (``GET /weights/group/state``), names the group to it (``POST /weights/group``: address,
port, world size, rank offset 1) and joins, blocking until every engine worker has
joined. Each bucket of a push is then broadcast while that bucket's ``/weights/update``
runs: the HTTP call on this thread, the broadcast on another, sent once every worker is
receiving. A broadcast that fails leaves the group unusable on both sides; the next push
makes a new one.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import urlsplit

import torch

from rollout_service.client import ServiceError
from rollout_service.protocol import messages
from rollout_service.protocol.broadcast import Group, GroupSpec, Rendezvous, join

T = TypeVar("T")

JOIN_MARGIN_S = 30.0
"""Beyond the group's own timeout, how long the trainer waits for its broadcast thread
after the update call has answered."""


def local_address_towards(url: str) -> str:
    """This host's address on the route to ``url``'s host: where the service's hosts reach
    the trainer's store (a UDP socket's local end; nothing is sent)."""
    parts = urlsplit(url)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((parts.hostname or "127.0.0.1", parts.port or 80))
        return str(probe.getsockname()[0])


class TrainerGroup:
    """Rank 0 of the trainer's group (module docstring).

    Args:
        state: ``GET /weights/group/state`` (the pusher's authenticated call).
        create: ``POST /weights/group``.
        release: ``POST /weights/group/release``.
        address: where the service's hosts reach this process.
        bucket_bytes: the largest bucket this trainer broadcasts.
        num_buckets: receive slots per engine worker (None: the service's).
        timeout_s: the group's collective timeout (None: the service's).
    """

    def __init__(self, *, state: Callable[[], messages.WeightGroupState],
                 create: Callable[[messages.WeightGroupRequest], messages.WeightGroupResponse],
                 release: Callable[[messages.WeightGroupRelease], object], address: str,
                 bucket_bytes: int, num_buckets: int | None = None,
                 timeout_s: float | None = None) -> None:
        self._state, self._create, self._release = state, create, release
        self._address = address
        self.bucket_bytes = bucket_bytes
        self._num_buckets = num_buckets
        self._timeout_s = timeout_s
        self._rendezvous: Rendezvous | None = None
        self._group: Group | None = None

    @property
    def device(self) -> torch.device:
        """Where the bucket buffers must be: this process's current GPU for NCCL, the CPU
        for gloo (joins first if needed)."""
        if self.joined().spec.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @property
    def group_id(self) -> str:
        return self.joined().spec.group_id

    def joined(self) -> Group:
        """The current group, made and joined first if there is none."""
        if self._group is None:
            state = self._state()
            if self._rendezvous is None:  # one store for the trainer's life
                self._rendezvous = Rendezvous(self._address, self._timeout_s or 600.0)
            answer = self._create(messages.WeightGroupRequest(
                group_id=f"trainer-{uuid.uuid4().hex[:12]}", master_address=self._address,
                master_port=self._rendezvous.port, world_size=1 + state.num_ranks,
                rank_offset=1, backend=state.backend, timeout_s=self._timeout_s,
                bucket_bytes=self.bucket_bytes, num_buckets=self._num_buckets))
            spec = GroupSpec(group_id=answer.group_id, master_address=answer.master_address,
                             master_port=answer.master_port, world_size=answer.world_size,
                             rank_offset=0, backend=answer.backend, timeout_s=answer.timeout_s)
            device = (torch.device("cuda", torch.cuda.current_device())
                      if spec.backend == "nccl" else None)
            try:
                self._group = join(spec, rank=0, device=device)
            except BaseException:
                self._release_quietly(answer.group_id)
                raise
        return self._group

    def during_update(self, key: str, payload: torch.Tensor, *, index: int, checksum: int,
                      update: Callable[[], T]) -> T:
        """Run ``update`` (the bucket's update call) while broadcasting ``payload`` as
        bucket ``key`` (sent once every worker is receiving it: ``Group.send_bucket``).

        Raises:
            whatever ``update`` raises (the group is closed unless the broadcast ended
            cleanly or never started); RuntimeError: the broadcast failed (the group is
            closed).
        """
        group = self.joined()
        failure: list[BaseException] = []
        refused = threading.Event()

        def send() -> None:
            try:
                group.send_bucket(payload, key, index=index, checksum=checksum,
                                  is_cancelled=refused.is_set)
            except BaseException as exc:  # handed to the caller below
                failure.append(exc)
                if not _was_cancelled(exc):
                    # At once, not after the update's answer: a worker blocked in gloo
                    # receiving from this rank ends only when its sockets close.
                    group.close()

        sender = threading.Thread(target=send, name="rollout-weights-broadcast", daemon=True)
        started = time.monotonic()
        sender.start()
        try:
            result = update()
        except BaseException as exc:
            refused.set()  # a sender still waiting for receivers stops waiting
            if not _keeps_group(exc):  # ends the receives still blocked on this rank
                group.close()
            sender.join(group.spec.timeout_s + JOIN_MARGIN_S)
            exc.add_note(f"the trainer's broadcast of {key}: {_sender_state(sender, failure)} "
                         f"{time.monotonic() - started:.1f} s after it started")
            if (sender.is_alive() or (failure and not _was_cancelled(failure[0]))
                    or not _keeps_group(exc)):
                self.close()
            raise
        sender.join(group.spec.timeout_s + JOIN_MARGIN_S)
        if sender.is_alive() or failure:
            self.close()
            raise RuntimeError(f"the weights broadcast of {key} failed: "
                               f"{failure[0] if failure else 'still running'!r}")
        return result

    def release(self) -> None:
        """Let the service go of the group, and leave it."""
        if self._group is not None:
            self._release_quietly(self._group.spec.group_id)
        self.close()

    def _release_quietly(self, group_id: str) -> None:
        try:
            self._release(messages.WeightGroupRelease(group_id=group_id))
        except Exception:  # the service may have let it go already; it times out anyway
            pass

    def close(self) -> None:
        """Leave the group (without telling the service: it closed it, or will); the next
        push makes a new one."""
        if self._group is not None:
            self._group.close()
            self._group = None


def _keeps_group(exc: BaseException) -> bool:
    """Whether the service kept the group after this update failure: a bucket it refused
    (400); anything else (a broken broadcast, a replica gone) closed it there."""
    return isinstance(exc, ServiceError) and exc.status == 400


def _was_cancelled(exc: BaseException) -> bool:
    return "the update was refused" in str(exc)


def _sender_state(sender: threading.Thread, failure: list[BaseException]) -> str:
    if failure:
        return f"failed ({failure[0]!r})"
    return "still running" if sender.is_alive() else "done"
