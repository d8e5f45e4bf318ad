"""The trainer's side of the ``nccl`` transport: its membership of the service's group.

Runs in the trainer process, inside ``WeightPusher(transport="nccl")``. The first push
asks the service for a group (``POST /weights/group``) and joins it as rank 0 (blocking
until every engine worker has joined); every push then broadcasts one byte buffer
while its ``finish`` call runs: the service receives it into its workers' buffers,
then loads main model and drafter from there. A push that fails in the broadcast
leaves the group unusable on both sides; the next push makes a new one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from rollout_service.protocol import messages
from rollout_service.protocol.broadcast import Group, GroupSpec, join

T = TypeVar("T")

JOIN_MARGIN_S = 30.0
"""Beyond the group's own timeout, how long the trainer waits for its broadcast thread
after ``finish`` has answered."""


class TrainerGroup:
    """Rank 0 of one service group (module docstring).

    Args:
        create: ``POST /weights/group`` (the pusher's authenticated call).
    """

    def __init__(self, create: Callable[[], messages.WeightGroupResponse]) -> None:
        self._create = create
        self._group: Group | None = None

    @property
    def device(self) -> torch.device:
        """Where the broadcast buffer must be: this process's current GPU for NCCL, the
        CPU for gloo (joins first if needed)."""
        group = self.joined()
        if group.spec.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @property
    def group_id(self) -> str:
        return self.joined().spec.group_id

    def joined(self) -> Group:
        """The current group, made and joined first if there is none."""
        if self._group is None:
            answer = self._create()
            spec = GroupSpec(group_id=answer.group_id, master_address=answer.master_address,
                             master_port=answer.master_port, world_size=answer.world_size,
                             backend=answer.backend, timeout_s=answer.timeout_s)
            device = (torch.device("cuda", torch.cuda.current_device())
                      if spec.backend == "nccl" else None)
            self._group = join(spec, rank=answer.trainer_rank, device=device)
        return self._group

    def during_broadcast(self, push_id: str, buffer: torch.Tensor,
                         finish: Callable[[], T]) -> T:
        """Run ``finish`` (the push's finish call) while broadcasting ``buffer`` (sent
        once every worker is receiving push ``push_id``: ``Group.send``).

        Raises:
            whatever ``finish`` raises (the group is closed unless the broadcast ended
            cleanly); RuntimeError: the broadcast failed (the group is closed).
        """
        group = self.joined()
        failure: list[BaseException] = []

        def send() -> None:
            try:
                group.send(buffer, push_id)
            except BaseException as exc:  # handed to the caller below
                failure.append(exc)

        sender = threading.Thread(target=send, name="rollout-weights-broadcast", daemon=True)
        started = time.monotonic()
        sender.start()
        try:
            result = finish()
        except BaseException as exc:  # what the trainer's own side did, for the why
            finished_s = time.monotonic() - started
            sender.join(group.spec.timeout_s + JOIN_MARGIN_S)  # its own timeout ends it
            exc.add_note(f"the trainer's broadcast, {finished_s:.1f} s after it started "
                         f"(when finish failed): {_sender_state(sender, failure)} "
                         f"{time.monotonic() - started:.1f} s after it started")
            raise
        finally:
            sender.join(group.spec.timeout_s + JOIN_MARGIN_S)
            if sender.is_alive() or failure:
                self.close()
        if failure:
            raise RuntimeError(f"the weights broadcast failed: {failure[0]!r}") from failure[0]
        return result

    def close(self) -> None:
        """Leave the group; the next push makes a new one."""
        if self._group is not None:
            self._group.close()
            self._group = None


def _sender_state(sender: threading.Thread, failure: list[BaseException]) -> str:
    if failure:
        return f"failed ({failure[0]!r})"
    return "still running" if sender.is_alive() else "done"
