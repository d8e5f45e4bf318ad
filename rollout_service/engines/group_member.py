"""One rank of the trainer's group on the serving side: joining it, and receiving each
push's buckets into a ring and the stored copy (``bucket_receiver.py``).

Runs in the process that holds the rank: each vLLM worker (``engines/vllm/
broadcast_backend.py``, called over vLLM's ``collective_rpc``) or the service process
in front of an SGLang server (``engines/sglang/group_receiver.py``). Joining and
receiving block on the other ranks, so both run on threads of their own; every method
here returns at once, and the caller follows a join or a bucket through its state.
No engine import.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from rollout_service.engines.broadcast_engine import BucketReceive, WorkerReceive
from rollout_service.engines.bucket_receiver import PushReceiver
from rollout_service.protocol.broadcast import Group, GroupSpec, join
from rollout_service.protocol.store import BucketInfo


class BackgroundCall:
    """One blocking call on its own thread, and how it ended."""

    def __init__(self, key: str, target: Any, *args: Any) -> None:
        self.key = key
        self.result: Any = None
        self.error: BaseException | None = None
        self._started = time.monotonic()
        self._ended: float | None = None
        self._thread = threading.Thread(target=self._run, args=(target, *args), daemon=True,
                                        name=f"rollout-{key}")
        self._thread.start()

    def _run(self, target: Any, *args: Any) -> None:
        try:
            self.result = target(*args)
        except BaseException as exc:  # reported through state(), never lost
            self.error = exc
        finally:
            self._ended = time.monotonic()

    def state(self) -> str:
        """``running``, ``done`` or ``failed after <seconds> s: <error>``."""
        if self._thread.is_alive():
            return "running"
        if self.error is None:
            return "done"
        assert self._ended is not None
        return f"failed after {self._ended - self._started:.1f} s: {self.error!r}"


class GroupMember:
    """One rank: its group (at most one at a time) and the receive of the push in flight.

    Args:
        device: where an ``nccl`` group's buffers live (the rank's GPU); a ``gloo``
            group's are on the CPU whatever this is.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._join: BackgroundCall | None = None
        self._is_writer = False
        self._receiver: PushReceiver | None = None

    def join_group(self, spec: GroupSpec, rank: int, *, is_writer: bool) -> None:
        """Start joining ``spec``'s group as ``rank`` (returns at once); an earlier group is
        let go. ``is_writer``: this rank writes the server's stored copy."""
        self.leave_group()
        device = self.device if spec.backend == "nccl" else None
        self._is_writer = is_writer
        self._join = BackgroundCall(spec.group_id, join, spec, rank, device)

    def group_state(self, group_id: str) -> str:
        """``running`` (joining), ``done`` (joined), ``failed: ...``, or ``unknown``."""
        if self._join is None or self._join.key != group_id:
            return "unknown"
        return self._join.state()

    def leave_group(self) -> None:
        """Leave the group first: a receive blocked in it then fails at once, and its
        threads end (leaving after them would wait out the group's timeout)."""
        if self._join is not None and self._join.state() == "done":
            self._join.result.close()
        self._join = None
        self._end_receive()

    def start_bucket(self, plan: BucketReceive, bucket: BucketInfo) -> None:
        """Queue one bucket's receive (returns at once); the push's first bucket sets up
        its receiver (ring, stored copy).

        Raises:
            RuntimeError: this rank has joined no group.
        """
        if self._receiver is None or self._receiver.push_id != plan.push_id:
            if self._join is None or self._join.state() != "done":
                raise RuntimeError("this rank has joined no group "
                                   f"({self._join.state() if self._join else 'none'})")
            self._end_receive()
            group: Group = self._join.result
            device = self.device if group.spec.backend == "nccl" else torch.device("cpu")
            self._receiver = PushReceiver(group, plan, device=device,
                                          is_writer=self._is_writer)
        self._receiver.start(bucket)

    def bucket_state(self, push_id: str, index: int) -> str:
        if self._receiver is None or self._receiver.push_id != push_id:
            return "unknown"
        return self._receiver.bucket_state(index)

    def receive_report(self, push_id: str, num_buckets: int) -> WorkerReceive:
        """The push's receive on this rank; once it ended (every bucket stored, or a
        failure), the receiver and its ring are let go."""
        if self._receiver is None or self._receiver.push_id != push_id:
            return WorkerReceive(state="unknown", peak_bytes=0)
        state, peak = self._receiver.report(num_buckets)
        checksums = self._receiver.copy_checksums()
        if state != "running":
            self._end_receive()
        return WorkerReceive(state=state, peak_bytes=peak, copy_checksums=checksums)

    def _end_receive(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None
