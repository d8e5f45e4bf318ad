"""Weight pushes under load: rollout throughput and pause times while the trainer pushes.

Runs in the caller's terminal process, which plays both the rollout client and
the trainer. It starts ``rollout-service serve`` as a child process, keeps
``--concurrency`` requests in flight at all times (each a fresh ``/generate`` of
``--max-tokens`` tokens), and alternates two kinds of rounds of ``--round-s``
seconds each, round by round so drift hits both alike:

- ``quiet``: only the requests;
- ``pushing``: the same requests while the trainer pushes main model and drafter
  (``target="both"``) back to back, ``WeightPusher`` from this process.

For each kind it prints the generated tokens/s (median and range over rounds),
and for the pushes, from the service's own timings: the drain (``pause_s``: with
``pause_mode="wait"`` running requests finish while new ones wait), the frozen
time (load of both models and resume: nothing generates) at p50 and p99, the
end-to-end push time, and the number of failed requests, which must be 0.

    python -m bench.push_under_load --model embedded:tiny --concurrency 8 --rounds 3 --round-s 20
    python -m bench.push_under_load --model embedded:1b --transport cuda_ipc --concurrency 128
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import secrets
import statistics
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from safetensors.torch import load_file

from rollout_service.client import RolloutClient
from rollout_service.embedded.corpus import arithmetic_prompts
from rollout_service.protocol import messages
from rollout_service.tools.launch import ServiceProcess
from trainer_client.push import WeightPusher

KINDS = ("quiet", "pushing")


@dataclasses.dataclass(kw_only=True, slots=True)
class Round:
    """What one round measured."""

    kind: str
    tokens_per_s: float
    num_failed: int
    drain_s: list[float] = dataclasses.field(default_factory=list)
    frozen_s: list[float] = dataclasses.field(default_factory=list)
    push_s: list[float] = dataclasses.field(default_factory=list)


class Load:
    """``concurrency`` workers, each sending one request after another until stopped."""

    def __init__(self, client: RolloutClient, concurrency: int, max_tokens: int) -> None:
        self._client = client
        self._concurrency = concurrency
        self._max_tokens = max_tokens
        self._prompts = [p for p, _ in arithmetic_prompts(concurrency, seed=3)]
        self.num_tokens = 0
        self.num_failed = 0
        self.errors: list[str] = []

    async def run_for(self, seconds: float) -> None:
        stop = time.monotonic() + seconds
        await asyncio.gather(*(self._worker(i, stop) for i in range(self._concurrency)))

    async def _worker(self, i: int, stop: float) -> None:
        request = messages.GenerateRequest(prompt=self._prompts[i], max_tokens=self._max_tokens,
                                           temperature=1.0, ignore_eos=True)
        while time.monotonic() < stop:
            try:
                response = await self._client.generate(request)
                self.num_tokens += len(response.outputs[0].token_ids)
            except Exception as exc:  # counted, shown, never retried
                self.num_failed += 1
                self.errors.append(repr(exc)[:300])


def push_until(pusher: WeightPusher, tensors: dict[str, torch.Tensor], stop: float,
               first_version: int, round_: Round) -> int:
    """Push back to back until ``stop``; returns the next free version."""
    version = first_version
    while time.monotonic() < stop:
        report = pusher.push(tensors.items(), version=version, target="both")
        timings = report.server.timings
        round_.drain_s.append(timings.pause_s)
        round_.frozen_s.append(timings.total_s - timings.pause_s)
        round_.push_s.append(report.total_s)
        version += 1
    return version


async def run(opts: argparse.Namespace, console: Console) -> list[Round]:
    token = secrets.token_hex(16)
    scratch = Path(tempfile.mkdtemp(prefix="bench-push-load-"))
    engine_kwargs = ({"dtype": "bfloat16", "enforce_eager": False, "kv_cache_memory_bytes": None,
                      "gpu_memory_utilization": opts.gpu_memory_utilization}
                     if opts.device == "cuda" else {})
    config = scratch / "service.json"
    config.write_text(json.dumps({"model": opts.model, "weights_token": token,
                                  "engine_kwargs": engine_kwargs,
                                  "weights_transport": opts.transport,
                                  "mtp": {"num_speculative_tokens": opts.num_speculative_tokens}}))
    with ServiceProcess(scratch / "service.log", config=config) as service:
        console.print(f"logs: {scratch}")
        service.wait_healthy(timeout_s=900)
        from rollout_service.config import ServiceConfig

        checkpoint = Path(ServiceConfig(model=opts.model).resolve_model()[0])
        device = "cuda" if opts.transport == "cuda_ipc" else "cpu"
        tensors = {name: t.to(device) for name, t in
                   load_file(str(checkpoint / "model.safetensors")).items()}
        rounds: list[Round] = []
        async with RolloutClient(service.url, weights_token=token,
                                 max_connections=opts.concurrency + 8) as client:
            version = (await client.weight_status()).newest_version + 1
            with WeightPusher(service.url, token, transport=opts.transport) as pusher:
                for r in range(opts.rounds + 1):  # the first pair warms up, untimed
                    for kind in KINDS if r % 2 == 0 else KINDS[::-1]:
                        load = Load(client, opts.concurrency, opts.max_tokens)
                        round_ = Round(kind=kind, tokens_per_s=0.0, num_failed=0)
                        start = time.monotonic()
                        if kind == "pushing":
                            stop = start + opts.round_s
                            pushes = asyncio.to_thread(push_until, pusher, tensors, stop,
                                                       version, round_)
                            _, version = await asyncio.gather(load.run_for(opts.round_s),
                                                              pushes)
                        else:
                            await load.run_for(opts.round_s)
                        round_.tokens_per_s = load.num_tokens / (time.monotonic() - start)
                        round_.num_failed = load.num_failed
                        for error in load.errors[:3]:
                            console.print(f"  failed request: {error}")
                        if r > 0:
                            rounds.append(round_)
                        console.print(f"round {r} {kind}: {round_.tokens_per_s:.0f} tok/s, "
                                      f"{len(round_.push_s)} pushes, "
                                      f"{round_.num_failed} failed")
    return rounds


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def print_report(console: Console, rounds: list[Round], opts: argparse.Namespace) -> None:
    console.print(f"{opts.model}, transport {opts.transport}, {opts.concurrency} requests in "
                  f"flight x {opts.max_tokens} tokens, {opts.rounds} rounds of {opts.round_s} s "
                  "per kind, interleaved")
    table = Table("kind", "median tok/s", "range tok/s", "pushes", "drain p50 s",
                  "frozen p50 s", "frozen p99 s", "push p50 s", "failed")
    for kind in KINDS:
        mine = [r for r in rounds if r.kind == kind]
        rates = [r.tokens_per_s for r in mine]
        drains = [d for r in mine for d in r.drain_s]
        frozen = [f for r in mine for f in r.frozen_s]
        pushes = [p for r in mine for p in r.push_s]

        def cell(values: list[float], q: float) -> str:
            return f"{percentile(values, q):.3f}" if values else "-"

        table.add_row(kind, f"{statistics.median(rates):.0f}",
                      f"{min(rates):.0f}-{max(rates):.0f}", str(len(pushes)),
                      cell(drains, 0.5), cell(frozen, 0.5), cell(frozen, 0.99),
                      cell(pushes, 0.5), str(sum(r.num_failed for r in mine)))
    console.print(table)
    pairs = [(p.tokens_per_s, q.tokens_per_s) for p, q in
             zip([r for r in rounds if r.kind == "pushing"],
                 [r for r in rounds if r.kind == "quiet"])]
    ratios = [p / q for p, q in pairs]
    console.print(f"pushing / quiet tokens/s: median {statistics.median(ratios):.3f} "
                  f"(range {min(ratios):.3f}-{max(ratios):.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded:tiny")
    parser.add_argument("--transport", choices=("shm", "cuda_ipc"), default="shm")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per kind")
    parser.add_argument("--round-s", type=float, default=20.0)
    parser.add_argument("--num-speculative-tokens", type=int, default=1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="default: cuda when vLLM's platform is CUDA")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    opts = parser.parse_args()
    if opts.device is None:  # NVML only: CUDA initialized here would break vLLM's fork
        from vllm.platforms import current_platform

        opts.device = "cuda" if current_platform.is_cuda() else "cpu"
    console = Console()
    rounds = asyncio.run(run(opts, console))
    print_report(console, rounds, opts)


if __name__ == "__main__":
    main()
