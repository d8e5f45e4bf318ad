"""A trainer that breaks one bucket of a ``nccl`` push on purpose: the fault cases of
the transport, driven through the real ``WeightPusher`` and real gloo.

Everything but the chosen bucket's broadcast is the real pusher's (begin, the stream, the
update calls, the group); that broadcast is replaced by one of :data:`FAULTS`:

- ``stall``: the update call goes out and every worker is receiving, but the trainer
  never sends (its process alive): the group's timeout ends it;
- ``die``: the trainer sends the bucket's header and exits (``os._exit``) before its
  bytes: the workers' connections close mid-broadcast (run it in a spawned process,
  :func:`push_and_die`);
- ``short``: the header announces the bucket's length, half of it follows;
- ``long``: the header announces more bytes than a worker's ring slot holds.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from rollout_service.protocol.broadcast import HEADER_MAGIC, Group, _signed
from trainer_client.push import WeightPusher

FAULTS = ("stall", "die", "short", "long")


def break_bucket(pusher: WeightPusher, fault: str, index: int) -> None:
    """From now on, ``pusher``'s bucket ``index`` of every push breaks as ``fault``."""
    assert fault in FAULTS, fault
    group = pusher._group  # the real TrainerGroup of the pusher
    assert group is not None
    honest = group.during_update

    def during_update(key: str, payload: torch.Tensor, *, index: int, checksum: int,
                      update: Callable[[], Any]) -> Any:
        if index != wanted:
            return honest(key, payload, index=index, checksum=checksum, update=update)
        member = group.joined()
        answer: list[Any] = []
        caller = threading.Thread(target=lambda: answer.append(_call(update)), daemon=True)
        caller.start()
        member._wait_ready(key, lambda: bool(answer))  # every worker is receiving
        _misbehave(member, fault, payload, index, checksum)
        caller.join(member.spec.timeout_s + 120)
        if fault != "short":  # its collectives matched the workers': the group lives on
            group.close()
        if isinstance(answer[0], BaseException):
            raise answer[0]
        return answer[0]

    wanted = index
    group.during_update = during_update  # type: ignore[method-assign]


def _call(update: Callable[[], Any]) -> Any:
    try:
        return update()
    except BaseException as exc:  # noqa: BLE001 - handed to the caller
        return exc


def _misbehave(member: Group, fault: str, payload: torch.Tensor, index: int,
               checksum: int) -> None:
    header = [HEADER_MAGIC, payload.numel(), _signed(checksum), index]
    if fault == "stall":
        return  # nothing is sent; the service's answer comes at the group's timeout
    if fault == "die":
        member.broadcast(torch.tensor(header, dtype=torch.int64))
        os._exit(3)
    if fault == "short":
        member.broadcast(torch.tensor(header, dtype=torch.int64))
        member.broadcast(payload[:payload.numel() // 2].clone())
        return
    header[1] = 1 << 40  # far past any worker's slot
    member.broadcast(torch.tensor(header, dtype=torch.int64))
    try:
        member.broadcast(torch.zeros(1 << 20, dtype=torch.uint8))
    except RuntimeError:  # the workers left the group instead of receiving it
        pass


def push_and_die(url: str, token: str, tensors_path: str, version: int, index: int,
                 bucket_bytes: int) -> None:
    """In a spawned process: push with bucket ``index`` broken as ``die``."""
    from safetensors.torch import load_file

    tensors = load_file(tensors_path)
    pusher = WeightPusher(url, token, transport="nccl", bucket_bytes=bucket_bytes)
    break_bucket(pusher, "die", index)
    pusher.push(tensors.items(), version=version)
    time.sleep(600)  # not reached: the broken bucket exits the process
