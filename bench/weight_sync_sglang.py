"""Weight sync on SGLang: a push of main model + drafter through the service, against
SGLang's own reload of both from disk, on one GPU (the sglang bundle).

Runs in the caller's process, which plays the trainer (``bench/weight_sync.py`` is the
vLLM counterpart and lends its rounds, parts and report). The modes, each once per round
after a warm-up round, the order rotated:

- ``sglang-shm``: ``rollout-service serve`` with ``engine: sglang`` (it launches SGLang),
  pushed to by ``WeightPusher`` over ``shm`` (``target="both"``) until it serves the new
  version: the service's ``/update_weights_from_tensor`` into each model.
- ``sglang-disk``: SGLang's own server on the same arguments. A round saves the trainer's
  tensors as the ``model.safetensors`` of a checkpoint directory (the embedded config and
  tokenizer beside it), then ``POST /update_weights_from_disk``: SGLang reloads the target
  and the drafter from it (``selector`` all) and flushes its cache. Unsynced save, read back
  from the page cache: both favour ``disk``.
- ``floor``: one device-to-device copy of every byte (the trainer's tensors are on the GPU).

At the end both servers must hold the same parameters: the service's checksums (SGLang's
per-engine checksum of each model, through the adapter) against the disk server's own
weight checker.

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
MODES = ("sglang-shm", "sglang-disk", "floor")


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
                ) -> tuple[dict[str, Timed], int, dict[str, dict[str, str]]]:
    model_path = ensure_model(opts.size)
    scratch = Path(tempfile.mkdtemp(prefix="bench-weight-sync-sglang-", dir="/tmp"))
    console.print(f"checkpoint: {model_path}; logs and files: {scratch}")
    token = secrets.token_hex(16)
    names = opts.modes.split(",")
    mtp = {"num_speculative_tokens": opts.num_speculative_tokens}
    with contextlib.ExitStack() as stack:
        tensors: StateDict = {}
        modes: dict[str, Mode] = {}
        service = push = disk = None
        if "sglang-shm" in names:
            config = scratch / "service.json"
            config.write_text(json.dumps({
                "model": f"embedded:{opts.size}", "engine": "sglang", "weights_token": token,
                "engine_kwargs": SERVER_ARGS, "mtp": mtp}))
            service = stack.enter_context(ServiceProcess(scratch / "service.log",
                                                         config=config))
            console.print("waiting for the service ...")
            service.wait_healthy(900)
        if "sglang-disk" in names:
            console.print("starting SGLang's own server ...")
            url = stack.enter_context(sglang_server(
                str(model_path), {**EMBEDDED_SGLANG_ENGINE_KWARGS, **SERVER_ARGS},
                MTPSettings(**mtp), scratch / "sglang-disk.log"))
            disk = modes["sglang-disk"] = DiskReload.prepare(url, tensors, model_path, scratch)
        # The trainer's tensors last: the servers sized their memory without them.
        tensors.update(load_file(str(model_path / "model.safetensors"), device="cuda:0"))
        if service is not None:
            pusher = stack.enter_context(WeightPusher(service.url, token, transport="shm"))
            push = modes["sglang-shm"] = PushBench("sglang-shm", service, pusher, tensors)
        if "floor" in names:
            modes["floor"] = FloorBench(tensors, "cuda")
        results = await run_rounds([modes[n] for n in names], tensors, opts.rounds, "cuda",
                                   console)
        checksums = {}
        if push is not None:
            checksums["sglang-shm"] = httpx.get(f"{push.service.url}/weights/checksums",
                                                headers=bearer(token), timeout=300).json()
        if disk is not None:
            checksums["sglang-disk"] = disk.checksums()
    return results, sum(t.nbytes for t in tensors.values()), checksums


def print_comparison(console: Console, results: dict[str, Timed],
                     checksums: dict[str, dict[str, str]]) -> bool:
    """The push against the reload and the floor; whether both servers hold the same."""
    table = Table("figure", "value")
    medians = {name: statistics.median(t.total_s) for name, t in results.items()}
    if {"sglang-shm", "sglang-disk"} <= set(medians):
        table.add_row("sglang-shm: speed-up over sglang-disk",
                      f"{medians['sglang-disk'] / medians['sglang-shm']:.2f}x")
    if {"sglang-shm", "floor"} <= set(medians):
        table.add_row("sglang-shm over the floor",
                      f"{medians['sglang-shm'] / medians['floor']:.1f}x")
    is_same = len({json.dumps(c, sort_keys=True) for c in checksums.values()}) <= 1
    for name, c in checksums.items():
        table.add_row(f"{name} checksums", f"main {c.get('main', '-')[:16]}, draft "
                      f"{c.get('draft', '-')[:16]}")
    table.add_row("same parameters in both servers", "yes" if is_same else "NO")
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
    results, num_bytes, checksums = asyncio.run(bench(opts, console))
    # print_report's fields: the trainer's tensors and the engines are on the GPU.
    report_opts = argparse.Namespace(size=opts.size, device="cuda", engine_device="cuda",
                                     engine_kwargs=SERVER_ARGS, rounds=opts.rounds)
    print_report(console, report_opts, num_bytes, results)
    sys.exit(0 if print_comparison(console, results, checksums) else 1)


if __name__ == "__main__":
    main()
