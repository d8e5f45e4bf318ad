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

This module is the driver (start, rounds, check, report); the modes it times are in
``bench/weight_sync_modes.py``, the tables and the JSON in ``bench/weight_sync_report.py``.

    python -m bench.weight_sync --size tiny --rounds 2 --modes shm,shm-reload,disk,floor
    python -m bench.weight_sync --size 1b --device cuda --json /tmp/ws-1b.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import secrets
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import torch
from rich.console import Console
from safetensors.torch import load_file

from bench.engine_options import json_object
from bench.weight_sync_modes import (
    PUSH_MODES,
    REFERENCE_MODES,
    DiskBench,
    FloorBench,
    Mode,
    PushBench,
    Run,
    StateDict,
    Timed,
)
from bench.weight_sync_report import print_checksums, print_report, write_json
from rollout_service.client import bearer
from rollout_service.embedded import ensure_model
from rollout_service.protocol import messages
from rollout_service.tools.launch import ServiceProcess
from trainer_client.push import WeightPusher

DEFAULT_MODES = {"cpu": "shm,disk,floor",
                 "cuda": "cuda_ipc,cuda_ipc-unstaged,cuda_ipc-reload,shm,floor"}
# Several engines share one GPU: a small, fixed KV cache and a modest share each.
# Without a GPU the service's embedded defaults apply, with the checkpoint's dtype.
ENGINE_KWARGS = {"cpu": {"dtype": "bfloat16"},
                 "cuda": {"dtype": "bfloat16", "enforce_eager": True,
                          "kv_cache_memory_bytes": 1024**3, "gpu_memory_utilization": 0.15}}
STARTUP_TIMEOUT_S = 900.0


class CheckFailed(Exception):
    """The services do not serve what was pushed: the figures measure a broken push."""


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


def engine_kwargs(overrides: dict[str, Any], is_cuda: bool) -> dict[str, Any]:
    """The engine kwargs of every engine: the defaults of vLLM's platform (several
    engines share one GPU) with ``--engine-kwargs`` on top."""
    return {**ENGINE_KWARGS["cuda" if is_cuda else "cpu"], **overrides}


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
    parser.add_argument("--engine-kwargs", type=json_object, default={},
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
    opts.engine_kwargs = engine_kwargs(opts.engine_kwargs, current_platform.is_cuda())
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
