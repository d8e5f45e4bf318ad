"""The timed modes of ``bench/weight_sync.py``: how each one gets the trainer's tensors
into the engine, and the seconds one run of it took, whole and in parts.

Runs in the caller's process, which plays the trainer; ``bench.weight_sync`` (and, through
it, ``bench.weight_sync_sglang``) calls each mode's ``run`` once per round. ``PushBench``
pushes over HTTP and the transport to its own ``rollout-service serve`` child through
``WeightPusher``; ``DiskBench`` drives an ``AsyncLLM`` in this process, whose worker
processes reload through ``bench/disk_reload.py``; ``FloorBench`` copies in this process.
Apart from the driver so that the driver reads as start, rounds, check, report, and each
mode's timing boundaries are read in one place.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import save_file

from rollout_service.config import EMBEDDED_ENGINE_KWARGS
from rollout_service.engines.base import WeightsLoad
from rollout_service.protocol.placement import Transport
from rollout_service.tools.launch import ServiceProcess
from trainer_client.push import PushReport, WeightPusher


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PushMode:
    """How a push travels (``weights_transport``) and how the engine loads it."""

    transport: Transport
    weights_load: WeightsLoad
    cuda_ipc_staging: bool = True
    """``cuda_ipc``: one staging buffer exported once, or every tensor exported in place."""


PUSH_MODES = {f"{t}{'-reload' if w == 'reload' else ''}": PushMode(transport=t, weights_load=w)
              for t in ("shm", "cuda_ipc", "nccl") for w in ("auto", "reload")}
PUSH_MODES["cuda_ipc-unstaged"] = PushMode(transport="cuda_ipc", weights_load="auto",
                                           cuda_ipc_staging=False)
REFERENCE_MODES = ("disk", "floor")
DISK_RELOAD_EXTENSION = "bench.disk_reload.DiskReloadExtension"
StateDict = dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Run:
    """One timed run of one mode: its total and its parts (name -> seconds)."""

    total_s: float
    parts: dict[str, float]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Timed:
    """Per-run seconds of one mode, and its parts (name -> per-run seconds)."""

    total_s: tuple[float, ...]
    parts: dict[str, tuple[float, ...]]

    @classmethod
    def of(cls, runs: list[Run]) -> Timed:
        return cls(total_s=tuple(r.total_s for r in runs),
                   parts={name: tuple(r.parts[name] for r in runs) for name in runs[0].parts})

    @property
    def median_s(self) -> float:
        return statistics.median(self.total_s)


class Mode(Protocol):
    """One way of getting the trainer's tensors into the engine, run once per round."""

    name: str

    async def run(self, version: int) -> Run: ...


class PushBench:
    """A push mode: its own service child, pushed to from a thread (``disk``'s loop keeps
    running meanwhile); ``WeightPusher`` times the push itself."""

    def __init__(self, name: str, service: ServiceProcess, pusher: WeightPusher,
                 tensors: StateDict) -> None:
        self.name = name
        self.service = service
        self._pusher = pusher
        self._tensors = tensors

    async def run(self, version: int) -> Run:
        report = await asyncio.to_thread(self._pusher.push, self._tensors.items(),
                                         version=version, target="both")
        return push_run(report)


def push_run(report: PushReport) -> Run:
    """A push's parts: the trainer's from ``PushReport``, the service's own timings."""
    server = report.server.timings
    parts = {"fill (trainer -> segment / export)": report.fill_s,
             "control: begin": report.begin_s,
             "control: updates": report.control_s - report.begin_s,
             "receive (nccl broadcast, before the pause)": server.receive_s,
             "pause": server.pause_s,
             "load main": server.load_main_s, "finalize main": server.finalize_main_s,
             "load draft": server.load_draft_s, "finalize draft": server.finalize_draft_s,
             "reset prefix cache + resume": server.resume_s}
    parts["other (finish round trip, HTTP)"] = report.total_s - sum(parts.values())
    return Run(total_s=report.total_s, parts=parts)


class DiskBench:
    """``disk``: save a safetensors checkpoint, reload main and drafter from it."""

    name = "disk"

    def __init__(self, llm: Any, tensors: StateDict, scratch: Path) -> None:
        self.llm = llm
        self._tensors = tensors
        self._scratch = scratch

    @classmethod
    def start(cls, model_path: Path, engine_kwargs: dict[str, Any], tensors: StateDict,
              scratch: Path) -> DiskBench:
        """Start the in-process engine (inside the running event loop, which serves it)."""
        from vllm.v1.engine.async_llm import AsyncLLM

        from rollout_service.engines.speculative import MTPSettings, load_checkpoint_config
        from rollout_service.engines.vllm.engine_args import build_engine_args

        args = build_engine_args(str(model_path), {**EMBEDDED_ENGINE_KWARGS, **engine_kwargs,
                                                   "worker_extension_cls": DISK_RELOAD_EXTENSION},
                                 MTPSettings(), load_checkpoint_config(model_path))
        return cls(AsyncLLM.from_engine_args(args), tensors, scratch)

    async def run(self, version: int) -> Run:
        path = self._scratch / f"step-{version}.safetensors"
        t0 = time.perf_counter()
        save_file(self._tensors, str(path))
        t1 = time.perf_counter()
        await self.llm.pause_generation(mode="wait")
        await self.llm.collective_rpc("rollout_load_safetensors", args=(str(path), False))
        t2 = time.perf_counter()
        await self.llm.collective_rpc("rollout_load_safetensors", args=(str(path), True))
        t3 = time.perf_counter()
        await self.llm.reset_prefix_cache()
        await self.llm.resume_generation()
        t4 = time.perf_counter()
        path.unlink()
        return Run(total_s=t4 - t0, parts={
            "save (trainer -> file)": t1 - t0, "pause + reload main": t2 - t1,
            "reload draft": t3 - t2, "reset prefix cache + resume": t4 - t3})

    async def checksums(self) -> dict[str, str]:
        return (await self.llm.collective_rpc("rollout_weight_checksums"))[0]


class FloorBench:
    """``floor``: the copies of every byte that any transfer makes, into preallocated
    buffers (allocated and faulted in by the warm-up round, outside the timings)."""

    name = "floor"

    def __init__(self, tensors: StateDict, device: str) -> None:
        self._tensors = tensors
        num_bytes = sum(t.nbytes for t in tensors.values())
        self._flat = torch.empty(num_bytes, dtype=torch.uint8, device=device)
        self._views, offset = [], 0
        for t in tensors.values():
            self._views.append(self._flat[offset:offset + t.nbytes].view(t.dtype).view(t.shape))
            offset += t.nbytes
        # A host transfer copies twice (trainer -> segment -> engine); on the GPU, once.
        self._hop2 = torch.empty_like(self._flat) if device == "cpu" else None

    async def run(self, version: int) -> Run:
        if self._hop2 is None:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for view, t in zip(self._views, self._tensors.values()):
                view.copy_(t)
            torch.cuda.synchronize()
            total_s = time.perf_counter() - t0
            return Run(total_s=total_s, parts={"trainer -> buffer (device to device)": total_s})
        # Plain memcpys, as the pusher's fill: torch's copy_ spreads over intra-op
        # threads, many times slower on a busy host with few cores.
        t0 = time.perf_counter()
        for view, t in zip(self._views, self._tensors.values()):
            ctypes.memmove(view.data_ptr(), t.data_ptr(), t.nbytes)
        t1 = time.perf_counter()
        ctypes.memmove(self._hop2.data_ptr(), self._flat.data_ptr(), self._flat.nbytes)
        t2 = time.perf_counter()
        return Run(total_s=t2 - t0, parts={"trainer -> buffer 1": t1 - t0,
                                           "buffer 1 -> buffer 2": t2 - t1})
