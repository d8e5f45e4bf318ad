"""Weight sync: push modes vs a disk checkpoint reload vs the copy floor, on CPU or one GPU.

Runs in the caller's terminal process, which plays the trainer: it loads the
embedded checkpoint's bf16 tensors once (``--device``: host memory, or ``cuda:0``),
changes a few before every round (untimed) and gets them into the main model and
the MTP drafter in each mode:

- ``<transport>`` / ``<transport>-reload`` (transport ``shm`` or ``cuda_ipc``): a
  ``rollout-service serve`` child with that ``weights_transport`` and
  ``weights_load`` (``auto`` for the plain name: in place on CUDA, reload on CPU),
  pushed to by ``WeightPusher`` (``target="both"``) until it serves the new
  version. ``cuda_ipc`` shares CUDA tensors: it needs ``--device cuda``; it copies
  them into the pusher's staging buffer (one export per push), and
  ``cuda_ipc-unstaged`` exports each tensor in place instead. ``nccl`` broadcasts in a
  collective group (gloo when the trainer's tensors are on the CPU; NCCL between two
  GPUs, which one GPU cannot host: NCCL refuses two ranks on one device).
- ``disk``: an ``AsyncLLM`` in this process on the same engine args; safetensors
  save to a temp dir, pause, reload main and drafter (``bench/disk_reload.py``),
  resume. Unsynced save, read back from the page cache: both favour ``disk``.
- ``floor``: the copies any transfer makes: two host memcpys (``--device cpu``), or
  one synchronized device-to-device copy of every byte (``--device cuda``: the
  memory-bandwidth floor of a push into GPU memory).

All services start up front, then ``disk``'s engine. After a warm-up round every
mode runs once per round, the order rotated each round so drift hits all alike.
A round pushes the same values to every service, so at the end all must serve the
last version with the same main and drafter checksums (in place and reload give
identical parameters), or the script exits 1.

    python -m bench.weight_sync --size tiny --rounds 2 --modes shm,shm-reload,disk,floor
    python -m bench.weight_sync --size 1b --device cuda --json /tmp/ws-1b.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import dataclasses
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

import httpx
import torch
from rich.console import Console
from rich.table import Table
from safetensors.torch import load_file, save_file

from rollout_service.client import bearer
from rollout_service.config import EMBEDDED_ENGINE_KWARGS
from rollout_service.embedded import ensure_model
from rollout_service.engines.base import WeightsLoad
from rollout_service.protocol import messages
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
DEFAULT_MODES = {"cpu": "shm,disk,floor",
                 "cuda": "cuda_ipc,cuda_ipc-unstaged,cuda_ipc-reload,shm,floor"}
# Several engines share one GPU: a small, fixed KV cache and a modest share each.
# Without a GPU the service's embedded defaults apply, with the checkpoint's dtype.
ENGINE_KWARGS = {"cpu": {"dtype": "bfloat16"},
                 "cuda": {"dtype": "bfloat16", "enforce_eager": True,
                          "kv_cache_memory_bytes": 1024**3, "gpu_memory_utilization": 0.15}}
DISK_RELOAD_EXTENSION = "bench.disk_reload.DiskReloadExtension"
STARTUP_TIMEOUT_S = 900.0
GPU_TARGET_S = {"1b": 0.060, "7b": 0.30}
"""The issue's targets for one push of main model + drafter into GPU memory."""
CPU_TARGET_SPEEDUP = 2.0
CPU_TARGET_GB_PER_S = 1.0
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


class CheckFailed(Exception):
    """The services do not serve what was pushed: the figures measure a broken push."""


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


def perturb(tensors: StateDict, step: int, device: str) -> None:
    """Change a few tensors in place so every push carries new values (untimed: the
    GPU's queue is drained here, not inside the next timing)."""
    for name in list(tensors)[:4]:
        tensors[name].add_(2**-6 if step % 2 else -2**-6)
    if device == "cuda":
        torch.cuda.synchronize()


def start_service(name: str, size: str, engine_kwargs: dict[str, Any], token: str,
                  log_dir: Path) -> ServiceProcess:
    """The service child of push mode ``name``, not yet waited for: all start at once."""
    mode = PUSH_MODES[name]
    config = log_dir / f"service-{name}.json"
    config.write_text(json.dumps({"model": f"embedded:{size}", "weights_token": token,
                                  "engine_kwargs": engine_kwargs,
                                  "weights_transport": mode.transport,
                                  "weights_load": mode.weights_load}))
    return ServiceProcess(log_dir / f"service-{name}.log", config=config)


async def run_rounds(modes: list[Mode], tensors: StateDict, num_rounds: int, device: str,
                     console: Console) -> dict[str, Timed]:
    """One warm-up round, then ``num_rounds`` rounds of every mode, the order rotated."""
    runs: dict[str, list[Run]] = {m.name: [] for m in modes}
    for r in range(num_rounds + 1):
        perturb(tensors, r + 1, device)
        shift = r % len(modes)
        done = []
        for mode in modes[shift:] + modes[:shift]:
            run = await mode.run(version=r + 1)
            done.append(f"{mode.name} {run.total_s:.3f} s")
            if r > 0:
                runs[mode.name].append(run)
        console.print(f"round {r}{' (warm-up)' if r == 0 else ''}: {', '.join(done)}")
    return {name: Timed.of(mode_runs) for name, mode_runs in runs.items()}


def check_pushes(pushes: list[PushBench], token: str, version: int) -> dict[str, dict[str, str]]:
    """Each service serves ``version`` in both models, and all report the same parameters.

    Returns:
        The checksums per push mode.

    Raises:
        CheckFailed: a service serves another version, or the checksums differ.
    """
    checksums: dict[str, dict[str, str]] = {}
    for push in pushes:
        url, headers = push.service.url, bearer(token)
        status = messages.WeightStatus.model_validate(
            httpx.get(f"{url}/weights/status", headers=headers, timeout=60).json())
        if (status.main_version, status.draft_version) != (version, version):
            raise CheckFailed(f"{push.name}: after pushing version {version} the service "
                               f"serves main {status.main_version}, draft {status.draft_version}")
        response = httpx.get(f"{url}/weights/checksums", headers=headers, timeout=300)
        response.raise_for_status()
        checksums[push.name] = response.json()
    if len({json.dumps(c, sort_keys=True) for c in checksums.values()}) > 1:
        lines = "\n".join(f"  {name}: {c}" for name, c in checksums.items())
        raise CheckFailed(f"after the same final push (version {version}) the services "
                           f"hold different parameters:\n{lines}")
    return checksums


async def bench(opts: argparse.Namespace, console: Console) -> tuple[dict[str, Timed], int]:
    """Start every mode, run the rounds, check what the services serve.

    Returns:
        The timings per mode, in ``--modes`` order, and the bytes per push.
    """
    model_path = ensure_model(opts.size)
    scratch = Path(tempfile.mkdtemp(prefix="bench-weight-sync-", dir="/tmp"))
    console.print(f"checkpoint: {model_path}; logs and files: {scratch}")
    token = secrets.token_hex(16)
    names = opts.modes.split(",")
    with contextlib.ExitStack() as stack:
        services = {n: stack.enter_context(start_service(n, opts.size,
                                                         opts.engine_kwargs, token, scratch))
                    for n in names if n in PUSH_MODES}
        for name, service in services.items():
            console.print(f"waiting for the {name} service ...")
            service.wait_healthy(STARTUP_TIMEOUT_S)
        # The trainer's tensors come last (``disk`` gets the dict, filled below): while
        # the engines start, each checking the GPU's free memory, this process holds
        # none, and it has not initialized CUDA when AsyncLLM starts its engine core.
        tensors: StateDict = {}
        modes: dict[str, Mode] = {}
        disk: DiskBench | None = None
        if "disk" in names:
            console.print("starting the disk engine ...")
            disk = modes["disk"] = DiskBench.start(model_path, opts.engine_kwargs, tensors,
                                                   scratch)
            stack.callback(disk.llm.shutdown)
        tensors.update(load_file(str(model_path / "model.safetensors"),
                                 device="cuda:0" if opts.device == "cuda" else "cpu"))
        for name, service in services.items():
            mode = PUSH_MODES[name]
            pusher = stack.enter_context(WeightPusher(
                service.url, token, transport=mode.transport,
                cuda_ipc_staging=mode.cuda_ipc_staging))
            modes[name] = PushBench(name, service, pusher, tensors)
        if "floor" in names:
            modes["floor"] = FloorBench(tensors, opts.device)
        ordered = [modes[n] for n in names]
        results = await run_rounds(ordered, tensors, opts.rounds, opts.device, console)
        pushes = [m for m in ordered if isinstance(m, PushBench)]
        checksums = check_pushes(pushes, token, version=opts.rounds + 1)
        if disk is not None:  # a reference: shown, not required to match
            checksums["disk"] = await disk.checksums()
    print_checksums(console, checksums)
    return {n: results[n] for n in names}, sum(t.nbytes for t in tensors.values())


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return f"CPU, {os.cpu_count()} cores, trainer torch threads {torch.get_num_threads()}"


def print_checksums(console: Console, checksums: dict[str, dict[str, str]]) -> None:
    table = Table("mode", "main sha256", "draft sha256", "same as first")
    first = next(iter(checksums.values()), {})
    for name, c in checksums.items():
        table.add_row(name, c.get("main", "-")[:16], c.get("draft", "-")[:16],
                      "yes" if c == first else "NO")
    console.print(table)


def print_report(console: Console, opts: argparse.Namespace, num_bytes: int,
                 results: dict[str, Timed]) -> None:
    """Totals, parts per mode, and the ratios and targets that decide the question."""
    console.print(f"model: embedded:{opts.size}, main + MTP drafter; engines on "
                  f"{opts.engine_device}, kwargs {opts.engine_kwargs}; trainer tensors on "
                  f"{opts.device}: {device_name(opts.device)}; load average "
                  f"{os.getloadavg()[0]:.1f}")
    console.print(f"bytes per push: {num_bytes:,} ({num_bytes / 1e9:.3f} GB), written once: "
                  f"the drafter loads from the same bytes; {opts.rounds} rounds after 1 "
                  "warm-up, order rotated each round")
    table = Table("mode", "median s", "min - max s", "GB/s (median)")
    for name, timed in results.items():
        table.add_row(name, f"{timed.median_s:.4f}",
                      f"{min(timed.total_s):.4f} - {max(timed.total_s):.4f}",
                      f"{num_bytes / timed.median_s / 1e9:.2f}")
    console.print(table)
    for name, timed in results.items():
        parts = Table(f"{name}: part", "median s", "min - max s", "% of total")
        for part, values in timed.parts.items():
            median = statistics.median(values)
            parts.add_row(part, f"{median:.4f}", f"{min(values):.4f} - {max(values):.4f}",
                          f"{100 * median / timed.median_s:.0f}")
        console.print(parts)
    ratios = Table("figure", "value", "target", "met")
    for row in ratio_rows(opts, num_bytes, {n: t.median_s for n, t in results.items()}):
        ratios.add_row(*row)
    if ratios.row_count:
        console.print(ratios)


def ratio_rows(opts: argparse.Namespace, num_bytes: int,
               medians: dict[str, float]) -> list[tuple[str, str, str, str]]:
    """(figure, value, target, met) rows: each push mode against the floor, the disk
    reload and the issue's target; in place against reload per transport."""
    rows = []

    def met(ok: bool) -> str:
        return "yes" if ok else "NO"

    for name in (n for n in medians if n in PUSH_MODES):
        push_s = medians[name]
        rate = num_bytes / push_s / 1e9
        if "floor" in medians:
            rows.append((f"{name} over the floor", f"{push_s / medians['floor']:.1f}x", "-", "-"))
        if "disk" in medians:
            speedup = medians["disk"] / push_s
            target = CPU_TARGET_SPEEDUP if opts.device == "cpu" else None
            rows.append((f"{name}: speed-up over disk", f"{speedup:.2f}x",
                         f">= {target:g}x" if target else "-",
                         met(speedup >= target) if target else "-"))
        if opts.device == "cpu":
            rows.append((f"{name}: rate, end to end", f"{rate:.2f} GB/s",
                         f">= {CPU_TARGET_GB_PER_S:g} GB/s", met(rate >= CPU_TARGET_GB_PER_S)))
        elif opts.size in GPU_TARGET_S:
            target_s = GPU_TARGET_S[opts.size]
            rows.append((f"{name}: push, end to end", f"{push_s * 1e3:.1f} ms ({rate:.1f} GB/s)",
                         f"<= {target_s * 1e3:.0f} ms (>= {num_bytes / target_s / 1e9:.0f} GB/s)",
                         met(push_s <= target_s)))
        if name.endswith("-reload") and name.removesuffix("-reload") in medians:
            in_place = name.removesuffix("-reload")
            rows.append((f"{in_place} over {name}: speed-up",
                         f"{push_s / medians[in_place]:.2f}x", "-", "-"))
    return rows


def write_json(path: Path, opts: argparse.Namespace, num_bytes: int,
               results: dict[str, Timed]) -> None:
    """The raw per-run numbers, for plots and comparisons across machines."""
    path.write_text(json.dumps({
        "size": opts.size, "device": opts.device, "device_name": device_name(opts.device),
        "engine_kwargs": opts.engine_kwargs, "num_bytes": num_bytes, "rounds": opts.rounds,
        "modes": {name: {"total_s": list(t.total_s),
                         "parts": {p: list(v) for p, v in t.parts.items()}}
                  for name, t in results.items()}}, indent=2))


def engine_kwargs(overrides: str, is_cuda: bool,
                  parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The engine kwargs of every engine: the defaults of vLLM's platform (several
    engines share one GPU) with ``--engine-kwargs`` on top."""
    try:
        extra = json.loads(overrides)
    except json.JSONDecodeError as exc:
        parser.error(f"--engine-kwargs: not JSON: {exc}")
    if not isinstance(extra, dict):
        parser.error("--engine-kwargs: must be a JSON object")
    return {**ENGINE_KWARGS["cuda" if is_cuda else "cpu"], **extra}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=("tiny", "small", "1b", "7b"),
                        help="embedded model size")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where the trainer's tensors live (cuda: cuda:0); the engines run "
                             "where vLLM's build runs them, whatever this says")
    parser.add_argument("--modes", default=None, help=(
        f"comma-separated subset of {','.join([*PUSH_MODES, *REFERENCE_MODES])}; default "
        f"{DEFAULT_MODES['cpu']} (cpu), {DEFAULT_MODES['cuda']} (cuda)"))
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (after 1 warm-up)")
    parser.add_argument("--engine-kwargs", default="{}",
                        help="JSON object merged over the engine kwargs of every engine")
    parser.add_argument("--json", type=Path, default=None, help="also write the raw runs here")
    opts = parser.parse_args(argv)
    opts.modes = opts.modes or DEFAULT_MODES[opts.device]
    names = opts.modes.split(",")
    unknown = sorted(set(names) - {*PUSH_MODES, *REFERENCE_MODES})
    if unknown:
        parser.error(f"--modes: unknown {unknown}")
    if len(set(names)) != len(names):
        parser.error(f"--modes: {opts.modes!r} names a mode twice")
    if opts.rounds < 1:
        parser.error("--rounds: must be >= 1")
    if opts.device == "cpu" and any(PUSH_MODES[n].transport == "cuda_ipc"
                                    for n in names if n in PUSH_MODES):
        parser.error("--modes: cuda_ipc shares CUDA tensors in place; add --device cuda")
    from vllm.platforms import current_platform  # NVML only: CUDA stays uninitialized

    if opts.device == "cuda" and not current_platform.is_cuda():
        parser.error(f"--device cuda: vLLM runs on {current_platform.device_type} here")
    opts.engine_kwargs = engine_kwargs(opts.engine_kwargs, current_platform.is_cuda(), parser)
    opts.engine_device = current_platform.device_type
    return opts


def main() -> None:
    opts = parse_args()
    console = Console()
    try:
        results, num_bytes = asyncio.run(bench(opts, console))
    except CheckFailed as exc:
        console.print(f"[bold red]FAILED[/bold red]: {exc}")
        sys.exit(1)
    print_report(console, opts, num_bytes, results)
    if opts.json is not None:
        write_json(opts.json, opts, num_bytes, results)
        console.print(f"raw runs: {opts.json}")


if __name__ == "__main__":
    main()
