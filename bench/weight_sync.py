"""Weight sync: the shm push vs a disk checkpoint reload vs the memcpy floor.

Runs in the caller's terminal process, which plays the trainer: it loads the
embedded checkpoint's tensors (bf16) into its own memory once, perturbs a few
of them before every push (untimed), and measures three ways of getting them
into both the main model and the MTP drafter, one after another:

- ``a`` (push): ``rollout-service serve`` as a child process (``ServiceProcess``,
  engine dtype bf16 so the engine holds the checkpoint's dtype), reached with
  ``WeightPusher.push(..., target="both")``: trainer memory -> shared-memory
  segment -> both models, timed until the service serves the new version. The
  drafter reads the same segment, so the trainer writes the bytes once.
- ``b`` (disk): the common alternative, in this process with ``AsyncLLM`` on the
  same engine args: ``safetensors.torch.save_file`` of the full state dict to a
  local-disk temp dir, then pause, reload main and drafter from that file
  (``rollout_load_safetensors``), reset the prefix cache, resume. The save is
  not fsynced and the file is most likely still in the page cache when it is
  read back, both of which favour ``b``.
- ``c`` (floor): two ``torch`` copies of the same bytes into preallocated flat
  buffers (trainer -> buffer 1 -> buffer 2), the two copies any same-host
  transfer makes.

Each figure is the median of ``--pushes`` timed runs after one warm-up.

    python -m bench.weight_sync --size tiny --pushes 2
    python -m bench.weight_sync --trainer-threads 1   # small, 5 pushes, one copy thread
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import secrets
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch
from rich.console import Console
from rich.table import Table
from safetensors.torch import load_file, save_file

from rollout_service.config import EMBEDDED_ENGINE_KWARGS
from rollout_service.embedded import ensure_model
from rollout_service.protocol import messages
from rollout_service.tools.launch import ServiceProcess
from trainer_client.push import PushReport, WeightPusher

MODES = ("a", "b", "c")
DISK_RELOAD_EXTENSION = "bench.disk_reload.DiskReloadExtension"
ENGINE_KWARGS = {"dtype": "bfloat16"}
STARTUP_TIMEOUT_S = 900.0
TARGET_SPEEDUP = 2.0
TARGET_GB_PER_S = 1.0
StateDict = dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Timed:
    """Per-run seconds of one mode, and its parts (name -> per-run seconds)."""

    total_s: tuple[float, ...]
    parts: dict[str, tuple[float, ...]]


def perturb(tensors: StateDict, step: int) -> None:
    """Change a few tensors in place so every push carries new values (untimed)."""
    for name in list(tensors)[:4]:
        tensors[name].add_(2**-6 if step % 2 else -2**-6)


def bench_push(size: str, tensors: StateDict, num_pushes: int, scratch: Path) -> Timed:
    """Mode ``a``: the shm push into a running service, main and drafter in one window."""
    token = secrets.token_hex(16)
    config_path = scratch / "service.json"
    config_path.write_text(json.dumps({"model": f"embedded:{size}", "weights_token": token,
                                       "engine_kwargs": ENGINE_KWARGS}))
    with ServiceProcess(scratch / "service.log", config=config_path) as proc:
        proc.wait_healthy(STARTUP_TIMEOUT_S)
        reports: list[PushReport] = []
        with WeightPusher(proc.url, token) as pusher:
            for version in range(1, num_pushes + 2):
                perturb(tensors, version)
                reports.append(pusher.push(tensors.items(), version=version, target="both"))
        status = messages.WeightStatus.model_validate(httpx.get(
            f"{proc.url}/weights/status", headers={"authorization": f"Bearer {token}"}).json())
    last = num_pushes + 1
    if (status.main_version, status.draft_version) != (last, last):
        raise RuntimeError(f"after pushing version {last} the service reports main "
                           f"{status.main_version}, draft {status.draft_version}")
    timed = reports[1:]
    server = [r.server.timings for r in timed]
    parts = {
        "fill (trainer -> segment)": tuple(r.fill_s for r in timed),
        "control (begin + updates)": tuple(r.control_s for r in timed),
        "pause": tuple(t.pause_s for t in server),
        "load main": tuple(t.load_main_s for t in server),
        "finalize main (engine post-processing)": tuple(t.finalize_main_s for t in server),
        "load draft": tuple(t.load_draft_s for t in server),
        "finalize draft": tuple(t.finalize_draft_s for t in server),
        "reset prefix cache + resume": tuple(t.resume_s for t in server),
    }
    totals = tuple(r.total_s for r in timed)
    parts["other (finish round trip, HTTP)"] = tuple(
        total - sum(p[i] for p in parts.values()) for i, total in enumerate(totals))
    return Timed(total_s=totals, parts=parts)


async def bench_disk(model_path: Path, tensors: StateDict, num_pushes: int,
                     scratch: Path) -> Timed:
    """Mode ``b``: save a safetensors checkpoint, reload main and drafter from it."""
    from vllm.v1.engine.async_llm import AsyncLLM

    from rollout_service.engines.speculative import MTPSettings, load_checkpoint_config
    from rollout_service.engines.vllm.engine import build_engine_args

    args = build_engine_args(str(model_path), {**EMBEDDED_ENGINE_KWARGS, **ENGINE_KWARGS,
                                               "worker_extension_cls": DISK_RELOAD_EXTENSION},
                             MTPSettings(), load_checkpoint_config(model_path))
    llm = AsyncLLM.from_engine_args(args)
    runs: list[tuple[float, float, float, float]] = []
    try:
        for step in range(num_pushes + 1):
            perturb(tensors, step)
            path = scratch / f"step-{step}.safetensors"
            t0 = time.perf_counter()
            save_file(tensors, str(path))
            t1 = time.perf_counter()
            await llm.pause_generation(mode="wait")
            await llm.collective_rpc("rollout_load_safetensors", args=(str(path), False))
            t2 = time.perf_counter()
            await llm.collective_rpc("rollout_load_safetensors", args=(str(path), True))
            t3 = time.perf_counter()
            await llm.reset_prefix_cache()
            await llm.resume_generation()
            t4 = time.perf_counter()
            path.unlink()
            runs.append((t1 - t0, t2 - t1, t3 - t2, t4 - t0))
    finally:
        llm.shutdown()
    timed = runs[1:]
    return Timed(total_s=tuple(r[3] for r in timed), parts={
        "save (trainer -> file)": tuple(r[0] for r in timed),
        "reload (pause, main, draft, resume)": tuple(r[3] - r[0] for r in timed),
        "  of which pause + reload main": tuple(r[1] for r in timed),
        "  of which reload draft": tuple(r[2] for r in timed)})


def bench_floor(tensors: StateDict, num_pushes: int) -> Timed:
    """Mode ``c``: trainer tensors -> flat buffer 1 -> flat buffer 2, preallocated."""
    num_bytes = sum(t.nbytes for t in tensors.values())
    hop1 = torch.empty(num_bytes, dtype=torch.uint8)
    hop2 = torch.empty_like(hop1)
    views, offset = [], 0
    for t in tensors.values():
        views.append(hop1[offset:offset + t.nbytes].view(t.dtype).view(t.shape))
        offset += t.nbytes
    runs: list[tuple[float, float]] = []
    for _ in range(num_pushes + 1):  # the first run faults the pages in
        t0 = time.perf_counter()
        for view, t in zip(views, tensors.values()):
            view.copy_(t)
        t1 = time.perf_counter()
        hop2.copy_(hop1)
        runs.append((t1 - t0, time.perf_counter() - t1))
    timed = runs[1:]
    return Timed(total_s=tuple(a + b for a, b in timed), parts={
        "trainer -> buffer 1": tuple(r[0] for r in timed),
        "buffer 1 -> buffer 2": tuple(r[1] for r in timed)})


def print_report(console: Console, size: str, num_bytes: int, num_pushes: int,
                 results: dict[str, Timed]) -> None:
    console.print(f"model: embedded:{size}, main + MTP drafter, engine dtype bfloat16 (the "
                  f"checkpoint's dtype: no conversion on load); trainer torch threads "
                  f"{torch.get_num_threads()} on {os.cpu_count()} CPUs, load average "
                  f"{os.getloadavg()[0]:.1f}")
    console.print(f"bytes per push: {num_bytes:,} ({num_bytes / 1e9:.3f} GB), written once "
                  "by the trainer: the drafter loads from the same segment (a) / file (b)")
    console.print(f"each figure: median of {num_pushes} runs after 1 warm-up")
    labels = {"a": "(a) shm push, end to end", "b": "(b) save + disk reload",
              "c": "(c) floor: 2 memcpys"}
    table = Table("mode", "median s", "min - max s", "GB/s (median)")
    for mode, timed in results.items():
        median = statistics.median(timed.total_s)
        table.add_row(labels[mode], f"{median:.3f}",
                      f"{min(timed.total_s):.3f} - {max(timed.total_s):.3f}",
                      f"{num_bytes / median / 1e9:.2f}")
    console.print(table)
    for mode, timed in results.items():
        parts = Table(f"{labels[mode]}: part", "median s", "min - max s", "% of total")
        total = statistics.median(timed.total_s)
        for name, values in timed.parts.items():
            median = statistics.median(values)
            parts.add_row(name, f"{median:.3f}", f"{min(values):.3f} - {max(values):.3f}",
                          f"{100 * median / total:.0f}")
        console.print(parts)
    medians = {mode: statistics.median(t.total_s) for mode, t in results.items()}
    ratios = Table("figure", "value", "target", "met")
    if "a" in medians and "b" in medians:
        speedup = medians["b"] / medians["a"]
        ratios.add_row("speed-up of the push over a disk reload (b / a)", f"{speedup:.2f}x",
                       f">= {TARGET_SPEEDUP:g}x", "yes" if speedup >= TARGET_SPEEDUP else "NO")
    if "a" in medians:
        rate = num_bytes / medians["a"] / 1e9
        ratios.add_row("push rate, end to end (a)", f"{rate:.2f} GB/s",
                       f">= {TARGET_GB_PER_S:g} GB/s", "yes" if rate >= TARGET_GB_PER_S else "NO")
    if "a" in medians and "c" in medians:
        ratios.add_row("push time over the floor (a / c)", f"{medians['a'] / medians['c']:.1f}x",
                       "-", "-")
    if ratios.row_count:
        console.print(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=("small", "tiny"),
                        help="embedded model size (tiny for a quick check)")
    parser.add_argument("--pushes", type=int, default=5, help="timed runs per mode")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated subset of {','.join(MODES)}")
    parser.add_argument("--trainer-threads", type=int, default=0,
                        help="torch threads of this (trainer) process; 0 keeps torch's default")
    opts = parser.parse_args()
    modes = [m for m in MODES if m in opts.modes.split(",")]
    unknown = sorted(set(opts.modes.split(",")) - set(MODES))
    if unknown or opts.pushes < 1 or opts.trainer_threads < 0:
        parser.error(f"--modes: unknown {unknown}" if unknown
                     else "--pushes: must be >= 1, --trainer-threads >= 0")
    if opts.trainer_threads:
        # Intra-op threads drive the trainer's copies ((a)'s fill, (c)); on a busy
        # machine with few cores, torch's default can be the slowest choice.
        torch.set_num_threads(opts.trainer_threads)
    console = Console()
    model_path = ensure_model(opts.size)
    tensors = load_file(str(model_path / "model.safetensors"))
    num_bytes = sum(t.nbytes for t in tensors.values())
    scratch = Path(tempfile.mkdtemp(prefix="bench-weight-sync-", dir="/tmp"))
    console.print(f"checkpoint: {model_path} ({len(tensors)} tensors); logs and files: "
                  f"{scratch}")
    results: dict[str, Timed] = {}
    for mode in modes:
        console.print(f"[bold]{mode}[/bold] ...")
        if mode == "a":
            results[mode] = bench_push(opts.size, tensors, opts.pushes, scratch)
        elif mode == "b":
            results[mode] = asyncio.run(bench_disk(model_path, tensors, opts.pushes, scratch))
        else:
            results[mode] = bench_floor(tensors, opts.pushes)
        console.print(f"  median {statistics.median(results[mode].total_s):.3f} s")
    print_report(console, opts.size, num_bytes, opts.pushes, results)


if __name__ == "__main__":
    main()
