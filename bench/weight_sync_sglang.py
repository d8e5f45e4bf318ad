"""Weight sync on SGLang: a push of main model + drafter through the service, against
SGLang's own reload of both from disk, on one GPU (the sglang bundle).

Runs in the caller's process, which plays the trainer (``bench/weight_sync.py`` is the
vLLM counterpart and lends its rounds, parts and report). The modes, each once per round
after a warm-up round, the order rotated:

- ``sglang-shm``: ``rollout-service serve`` with ``engine: sglang`` on SGLang's own
  server (``engine_url``), pushed to by ``WeightPusher`` over ``shm`` (``target="both"``)
  until it serves the new version: the service's ``/update_weights_from_tensor`` into
  each model, from a copy of the trainer's segment in host memory.
- ``sglang-cuda-ipc``: the same over ``cuda_ipc``: a second service with
  ``weights_transport: cuda_ipc`` on the same server (the push modes take turns, so one
  server start serves both); the trainer's staging buffer on the GPU, which SGLang's
  worker maps and slices (``engines/sglang/cuda_ipc_payload.py``). Not run yet.
- ``sglang-disk``: SGLang's own server on the same arguments. A round saves the trainer's
  tensors as the ``model.safetensors`` of a checkpoint directory (the embedded config and
  tokenizer beside it), then ``POST /update_weights_from_disk``: SGLang reloads the target
  and the drafter from it (``selector`` all) and flushes its cache. Unsynced save, read back
  from the page cache: both favour ``disk``.
- ``floor``: one device-to-device copy of every byte (the trainer's tensors are on the GPU).

At the end each push mode pushes a fresh change of the tensors and the disk server reloads
the same: both servers must then hold the same parameters, the service's checksums
(SGLang's per-engine checksum of each model, through the adapter) against the disk
server's own weight checker.

    python -m bench.weight_sync_sglang --size 1b --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table
from safetensors.torch import load_file, save_file

from bench.sglang_server import sglang_server
from bench.weight_sync import (
    FloorBench,
    Mode,
    PushBench,
    Run,
    StateDict,
    Timed,
    perturb,
    print_report,
    run_rounds,
)
from rollout_service.client import bearer
from rollout_service.config import EMBEDDED_SGLANG_ENGINE_KWARGS
from rollout_service.embedded import ensure_model
from rollout_service.engines.speculative import MTPSettings
from rollout_service.tools.launch import ServiceProcess
from trainer_client.push import WeightPusher

SERVER_ARGS = {"mem_fraction_static": 0.2, "disable_cuda_graph": True,
               "sampling_backend": "pytorch", "attention_backend": "fa3"}
"""Both servers': eager (no graph to recapture after a load), a fifth of the free memory."""
PUSH_TRANSPORTS = {"sglang-shm": "shm", "sglang-cuda-ipc": "cuda_ipc"}
MODES = (*PUSH_TRANSPORTS, "sglang-disk", "floor")
Checked = dict[str, tuple[dict[str, str], dict[str, str] | None]]
"""Push mode -> (its service's checksums, the disk server's after reloading the same)."""


class DiskReload:
    """``sglang-disk``: save a checkpoint, ``/update_weights_from_disk`` of both models."""

    name = "sglang-disk"

    def __init__(self, url: str, tensors: StateDict, checkpoint: Path) -> None:
        self.url = url
        self._tensors = tensors
        self._checkpoint = checkpoint

    @classmethod
    def prepare(cls, url: str, tensors: StateDict, model_path: Path, scratch: Path
                ) -> DiskReload:
        """A checkpoint directory whose weights file the rounds rewrite."""
        checkpoint = scratch / "checkpoint"
        checkpoint.mkdir()
        for path in model_path.iterdir():
            if path.name != "model.safetensors":
                (checkpoint / path.name).symlink_to(path)
        return cls(url, tensors, checkpoint)

    async def run(self, version: int) -> Run:
        t0 = time.perf_counter()
        host = {name: t.to("cpu") for name, t in self._tensors.items()}  # as a trainer saves
        save_file(host, str(self._checkpoint / "model.safetensors"))
        t1 = time.perf_counter()
        async with httpx.AsyncClient(timeout=600) as client:
            response = await client.post(f"{self.url}/update_weights_from_disk", json={
                "model_path": str(self._checkpoint), "weight_version": str(version)})
        t2 = time.perf_counter()
        if response.status_code != 200 or not response.json().get("success"):
            raise RuntimeError(f"/update_weights_from_disk: {response.status_code} "
                               f"{response.text}")
        return Run(total_s=t2 - t0, parts={"save (GPU -> host -> file)": t1 - t0,
                                           "reload main + draft, flush": t2 - t1})

    def checksums(self) -> dict[str, str]:
        """SGLang's own per-engine checksum of each model (the adapter's shape)."""
        return {role: httpx.post(f"{self.url}/weights_checker", timeout=300, json={
            "action": "checksum", "selector": selector}).json()["per_engine_checksum"]
            for role, selector in (("main", "target"), ("draft", "draft"))}


async def bench(opts: argparse.Namespace, console: Console
                ) -> tuple[dict[str, Timed], int, Checked]:
    model_path = ensure_model(opts.size)
    scratch = Path(tempfile.mkdtemp(prefix="bench-weight-sync-sglang-", dir="/tmp"))
    console.print(f"checkpoint: {model_path}; logs and files: {scratch}")
    token = secrets.token_hex(16)
    names = opts.modes.split(",")
    mtp = MTPSettings(num_speculative_tokens=opts.num_speculative_tokens)
    server_args = {**EMBEDDED_SGLANG_ENGINE_KWARGS, **SERVER_ARGS}
    with contextlib.ExitStack() as stack:
        tensors: StateDict = {}
        modes: dict[str, Mode] = {}
        services: dict[str, ServiceProcess] = {}
        disk = None
        push_names = [name for name in names if name in PUSH_TRANSPORTS]
        if push_names:
            console.print("starting SGLang's server for the pushes ...")
            # the first start on a machine compiles SGLang's JIT kernels
            url = stack.enter_context(sglang_server(str(model_path), server_args, mtp,
                                                    scratch / "sglang-push.log",
                                                    startup_timeout_s=900))
            for name in push_names:  # they only connect: all start at once
                services[name] = stack.enter_context(start_service(
                    name, url, opts.size, token, mtp, scratch))
            for service in services.values():
                service.wait_healthy(300)
        if "sglang-disk" in names:
            console.print("starting SGLang's own server ...")
            url = stack.enter_context(sglang_server(str(model_path), server_args, mtp,
                                                    scratch / "sglang-disk.log"))
            disk = modes["sglang-disk"] = DiskReload.prepare(url, tensors, model_path, scratch)
        # The trainer's tensors last: the servers sized their memory without them.
        tensors.update(load_file(str(model_path / "model.safetensors"), device="cuda:0"))
        pushes = []
        for name, service in services.items():
            pusher = stack.enter_context(WeightPusher(service.url, token,
                                                      transport=PUSH_TRANSPORTS[name]))
            pushes.append(PushBench(name, service, pusher, tensors))
            modes[name] = pushes[-1]
        if "floor" in names:
            modes["floor"] = FloorBench(tensors, "cuda")
        results = await run_rounds([modes[n] for n in names], tensors, opts.rounds, "cuda",
                                   console)
        checked = await check_each_push(pushes, disk, tensors, token, opts.rounds + 2)
    return results, sum(t.nbytes for t in tensors.values()), checked


def start_service(name: str, url: str, size: str, token: str, mtp: MTPSettings,
                  scratch: Path) -> ServiceProcess:
    """The service of push mode ``name`` on the server at ``url``, not yet waited for."""
    config = scratch / f"service-{name}.json"
    config.write_text(json.dumps({
        "model": f"embedded:{size}", "engine": "sglang", "engine_url": url,
        "weights_token": token, "weights_transport": PUSH_TRANSPORTS[name],
        "mtp": {"num_speculative_tokens": mtp.num_speculative_tokens}}))
    return ServiceProcess(scratch / f"service-{name}.log", config=config)


async def check_each_push(pushes: list[PushBench], disk: DiskReload | None,
                          tensors: StateDict, token: str, version: int) -> Checked:
    """Each push mode's own load against SGLang's reload: a fresh change of the tensors,
    pushed by the mode (the push modes share one server) and reloaded from disk."""
    checked: Checked = {}
    for push in pushes:
        perturb(tensors, version, "cuda")
        await push.run(version)
        own = httpx.get(f"{push.service.url}/weights/checksums", headers=bearer(token),
                        timeout=300).json()
        if disk is not None:
            await disk.run(version)
        checked[push.name] = (own, disk.checksums() if disk is not None else None)
        version += 1
    return checked


def print_comparison(console: Console, results: dict[str, Timed], checked: Checked) -> bool:
    """The pushes against the reload and the floor; whether each push loaded what the
    reload of the same tensors did."""
    table = Table("figure", "value")
    medians = {name: statistics.median(t.total_s) for name, t in results.items()}
    for name in PUSH_TRANSPORTS:
        for base in ("sglang-disk", "sglang-shm"):
            if name != base and {name, base} <= set(medians):
                table.add_row(f"{name}: speed-up over {base}",
                              f"{medians[base] / medians[name]:.2f}x")
        if {name, "floor"} <= set(medians):
            table.add_row(f"{name} over the floor", f"{medians[name] / medians['floor']:.1f}x")
    is_same = True
    for name, (own, reloaded) in checked.items():
        table.add_row(f"{name} checksums", f"main {own.get('main', '-')[:16]}, draft "
                      f"{own.get('draft', '-')[:16]}")
        if reloaded is not None:
            is_same &= own == reloaded
            table.add_row(f"sglang-disk reloading what {name} pushed",
                          "same parameters" if own == reloaded else
                          f"DIFFERENT: main {reloaded.get('main', '-')[:16]}, draft "
                          f"{reloaded.get('draft', '-')[:16]}")
    console.print(table)
    return is_same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1b", choices=("tiny", "small", "1b", "7b"))
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated subset of {','.join(MODES)}")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (after 1 warm-up)")
    parser.add_argument("--num-speculative-tokens", type=int, default=1)
    opts = parser.parse_args()
    unknown = sorted(set(opts.modes.split(",")) - set(MODES))
    if unknown or opts.rounds < 1:
        parser.error(f"--modes: unknown {unknown}" if unknown else "--rounds: must be >= 1")
    console = Console()
    results, num_bytes, checked = asyncio.run(bench(opts, console))
    # print_report's fields: the trainer's tensors and the engines are on the GPU.
    report_opts = argparse.Namespace(size=opts.size, device="cuda", engine_device="cuda",
                                     engine_kwargs=SERVER_ARGS, rounds=opts.rounds)
    print_report(console, report_opts, num_bytes, results)
    sys.exit(0 if print_comparison(console, results, checked) else 1)


if __name__ == "__main__":
    main()
