"""The ``nccl`` weight-transfer backend, inside vLLM's worker processes.

Each worker joins the service's collective group as rank ``1 + its rank`` (the trainer is
rank 0; ``protocol/broadcast.py``) and, once per push, receives the trainer's broadcast:
one byte buffer holding every tensor. The main model and the drafter then load from
views into that buffer (``transfer.LoadSession``, in place or by reload as for the other
backends), so the drafter receives nothing a second time; the buffer is let go after
the push's last load.

Joining and receiving block on the other ranks, so both run on a thread of their own:
vLLM's engine core keeps stepping while a worker waits for the trainer, and generation
pauses only for the copy into the parameters. The service follows a join through the
workers' state (``rollout_group_state`` of ``worker_ext.py``) and a receive through the
rendezvous store, where each worker counts itself when its receive ends, asking the
workers how it ended (``rollout_broadcast_state``) only then. Receiving into the
buffer touches no parameter, so a broadcast that fails (a trainer gone mid-way) leaves
the served weights exactly as they were.

Registered under the name ``rollout_nccl`` by :mod:`rollout_service.engines.vllm.plugin`
(vLLM's own ``nccl`` backend is another thing: a receive per tensor inside the update).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo

from rollout_service.engines.vllm.transfer import PushUpdateInfo, SessionLoads
from rollout_service.protocol.broadcast import Group, GroupSpec, join
from rollout_service.protocol.placement import BroadcastLocation
from rollout_service.protocol.tensors import view_in


@dataclass
class BroadcastInitInfo(WeightTransferInitInfo):
    """Nothing at start-up: groups are joined at run time (``rollout_group_join``)."""


class _Background:
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


class BroadcastWeightTransferEngine(SessionLoads,
                                    WeightTransferEngine[BroadcastInitInfo, PushUpdateInfo]):
    """Receives a push as one broadcast and loads main and drafter from it."""

    init_info_cls = BroadcastInitInfo
    update_info_cls = PushUpdateInfo
    supports_draft_weight_update = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._join: _Background | None = None
        self._receive: _Background | None = None

    def init_transfer_engine(self, init_info: BroadcastInitInfo) -> None:
        pass

    # ---- the group and the broadcast (worker_ext.py calls these) -------------------

    def join_group(self, spec: dict[str, Any], rank: int) -> None:
        """Start joining the group ``spec`` as ``rank`` (returns at once); an earlier
        group is let go."""
        self._close_group()
        group_spec = GroupSpec(**spec)
        device = self.device if group_spec.backend == "nccl" else None
        self._join = _Background(group_spec.group_id, join, group_spec, rank, device)

    def group_state(self, group_id: str) -> str:
        """``running`` (joining), ``done`` (joined), ``failed: ...``, or ``unknown``."""
        if self._join is None or self._join.key != group_id:
            return "unknown"
        return self._join.state()

    def start_receive(self, push_id: str, group_id: str, nbytes: int) -> None:
        """Start receiving push ``push_id``'s broadcast of ``nbytes`` (returns at once)."""
        if self.group_state(group_id) != "done":
            raise RuntimeError(f"group {group_id} is not joined on this worker "
                               f"({self.group_state(group_id)})")
        group: Group = self._join.result  # type: ignore[union-attr]
        device = self.device if group.spec.backend == "nccl" else torch.device("cpu")
        self._receive = _Background(push_id, self._received_buffer, group, push_id, nbytes,
                                    device)

    def receive_state(self, push_id: str) -> str:
        """``running``, ``done``, ``failed: ...``, or ``unknown``."""
        if self._receive is None or self._receive.key != push_id:
            return "unknown"
        return self._receive.state()

    @staticmethod
    def _received_buffer(group: Group, push_id: str, nbytes: int, device: torch.device
                         ) -> torch.Tensor:
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        group.receive(buffer, push_id)
        return buffer

    def _close_group(self) -> None:
        if self._join is not None and self._join.state() == "done":
            self._join.result.close()
        self._join = None
        self._receive = None

    # ---- vLLM's weight-update session (SessionLoads) -------------------------------

    def receive_weights(self, update_info: PushUpdateInfo) -> None:  # type: ignore[override]
        update_info.check_transport("nccl")
        if self.receive_state(update_info.push_id) != "done":
            raise RuntimeError(f"push {update_info.push_id}: its broadcast was not received "
                               f"({self.receive_state(update_info.push_id)})")
        assert self._receive is not None
        buffer: torch.Tensor = self._receive.result
        try:
            tensors = []
            for placement in update_info.placements:
                location = placement.location
                assert isinstance(location, BroadcastLocation)  # checked by PushUpdateInfo
                tensors.append((placement.name, view_in(buffer, location.offset,
                                                        placement.shape, placement.dtype)))
            self._load(update_info, "nccl", tensors)
        finally:
            if update_info.is_last_load:
                self._receive = None  # the buffer goes with it

    def shutdown(self) -> None:
        self._close_group()
