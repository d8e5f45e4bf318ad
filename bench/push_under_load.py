"""Weight pushes under load: rollout throughput and pause times while the trainer pushes.

Runs in the caller's terminal process, which plays both the rollout client and
the trainer. It starts ``rollout-service serve`` as a child process (or, with
``--ray-replicas N``, ``rollout-service serve-ray``: the Ray Serve app with N engine
replicas on the standalone service's share, ``bench/serving_ray.py``), keeps
``--concurrency`` requests in flight at all times (each a fresh ``/generate`` of
``--max-tokens`` tokens), and alternates two kinds of rounds of ``--round-s``
seconds each, round by round so drift hits both alike:

- ``quiet``: only the requests;
- ``pushing``: the same requests while the trainer pushes main model and drafter
  (``target="both"``) back to back, ``WeightPusher`` from this process.

For each kind it prints the generated tokens/s (median and range over rounds),
and for the pushes, from the service's own timings (Ray Serve: the slowest
replica's): the drain (``pause_s``: with ``pause_mode="wait"`` running requests
finish while new ones wait), the frozen time (load of both models and resume:
nothing generates; under Ray Serve a replica's gate then stays closed until every
replica has loaded, which this leaves out) at p50 and p99, the end-to-end push
time, the failed pushes and the failed requests, which must be 0.

``--pushes N`` runs pairs of rounds until the timed pushing rounds have made N pushes
(the last one stops at N) instead of ``--rounds`` pairs. The first pair warms up, untimed,
for ``--warmup-s`` each. Stopped early (Ctrl-C, or SIGTERM from a time limit), it still
prints the report of the rounds it finished.

    python -m bench.push_under_load --model embedded:tiny --concurrency 8 --rounds 3 --round-s 20
    python -m bench.push_under_load --model embedded:1b --transport cuda_ipc --concurrency 128
    python -m bench.push_under_load --model embedded:1b --ray-replicas 2 --concurrency 128 \
        --pushes 100
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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

from bench.serving_ray import ray_serve_config, start_serve_ray
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
    push_errors: list[str] = dataclasses.field(default_factory=list)
    request_errors: list[str] = dataclasses.field(default_factory=list)
    """The first few failed requests' errors."""
    drain_s: list[float] = dataclasses.field(default_factory=list)
    frozen_s: list[float] = dataclasses.field(default_factory=list)
    push_s: list[float] = dataclasses.field(default_factory=list)
    num_replicas_loaded: list[int] = dataclasses.field(default_factory=list)
    """Ray Serve: how many replicas each push loaded on (its finish answer's list)."""


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
               first_version: int, round_: Round, max_pushes: int | None = None) -> int:
    """Push back to back until ``stop`` or ``max_pushes`` (failed ones included); returns
    the next free version."""
    version = first_version
    while time.monotonic() < stop and (
            max_pushes is None or len(round_.push_s) + len(round_.push_errors) < max_pushes):
        try:
            report = pusher.push(tensors.items(), version=version, target="both")
        except Exception as exc:  # counted and shown; the next push takes a newer version
            round_.push_errors.append(repr(exc)[:300])
            version += 1
            continue
        timings = report.server.timings
        round_.drain_s.append(timings.pause_s)
        round_.frozen_s.append(timings.total_s - timings.pause_s)
        round_.push_s.append(report.total_s)
        round_.num_replicas_loaded.append(len(report.server.replicas or ()))
        version += 1
    return version


def start_service(opts: argparse.Namespace, scratch: Path, token: str,
                  stack: contextlib.ExitStack) -> ServiceProcess:
    """The standalone service, or the Ray Serve app of ``--ray-replicas``, serving; ``stack``
    stops it."""
    engine_kwargs = ({"dtype": "bfloat16", "enforce_eager": False, "kv_cache_memory_bytes": None,
                      "gpu_memory_utilization": opts.gpu_memory_utilization}
                     if opts.device == "cuda" else {})
    service = {"model": opts.model, "weights_token": token, "engine_kwargs": engine_kwargs,
               "weights_transport": opts.transport,
               "mtp": {"num_speculative_tokens": opts.num_speculative_tokens}}
    if opts.ray_replicas:
        config = ray_serve_config(service, num_replicas=opts.ray_replicas, device=opts.device,
                                  max_ongoing_requests=opts.concurrency, scratch=scratch)
        process = start_serve_ray(config, scratch, device=opts.device)
        stack.callback(process.stop)
        return process
    path = scratch / "service.json"
    path.write_text(json.dumps(service))
    process = stack.enter_context(ServiceProcess(scratch / "service.log", config=path))
    process.wait_healthy(timeout_s=900)
    return process


def num_pushes(rounds: list[Round]) -> int:
    """Pushes tried in ``rounds``, failed ones included."""
    return sum(len(r.push_s) + len(r.push_errors) for r in rounds)


def wants_another_pair(opts: argparse.Namespace, pair: int, timed: list[Round]) -> bool:
    """Pair 0 warms up, untimed; then ``--rounds`` pairs, or with ``--pushes N`` pairs until
    the timed ones tried N pushes."""
    if opts.pushes:
        return pair == 0 or num_pushes(timed) < opts.pushes
    return pair <= opts.rounds


async def one_round(kind: str, client: RolloutClient, pusher: WeightPusher,
                    tensors: dict[str, torch.Tensor], version: int, opts: argparse.Namespace,
                    seconds: float, max_pushes: int | None) -> tuple[Round, int]:
    """One round of ``kind``, ``seconds`` long; returns it and the next free version."""
    load = Load(client, opts.concurrency, opts.max_tokens)
    round_ = Round(kind=kind, tokens_per_s=0.0, num_failed=0)
    start = time.monotonic()
    if kind == "pushing":
        pushes = asyncio.to_thread(push_until, pusher, tensors, start + seconds, version,
                                   round_, max_pushes)
        _, version = await asyncio.gather(load.run_for(seconds), pushes)
    else:
        await load.run_for(seconds)
    round_.tokens_per_s = load.num_tokens / (time.monotonic() - start)
    round_.num_failed = load.num_failed
    round_.request_errors = load.errors[:3]
    return round_, version


async def run(opts: argparse.Namespace, console: Console, rounds: list[Round]) -> None:
    """Start the service and measure, appending each timed round to ``rounds`` as it ends
    (what an interrupted run leaves there is still reported)."""
    token = secrets.token_hex(16)
    scratch = Path(opts.logs or tempfile.mkdtemp(prefix="bench-push-load-"))
    scratch.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        service = start_service(opts, scratch, token, stack)
        console.print(f"logs: {scratch}")
        from rollout_service.config import ServiceConfig

        checkpoint = Path(ServiceConfig(model=opts.model).resolve_model()[0])
        device = "cuda" if opts.transport == "cuda_ipc" else "cpu"
        tensors = {name: t.to(device) for name, t in
                   load_file(str(checkpoint / "model.safetensors")).items()}
        async with RolloutClient(service.url, weights_token=token,
                                 max_connections=opts.concurrency + 8) as client:
            version = (await client.weight_status()).newest_version + 1
            with WeightPusher(service.url, token, transport=opts.transport) as pusher:
                r = 0
                while wants_another_pair(opts, r, rounds):
                    for kind in KINDS if r % 2 == 0 else KINDS[::-1]:
                        budget = opts.pushes - num_pushes(rounds) if opts.pushes and r else None
                        seconds = opts.round_s if r else opts.warmup_s
                        round_, version = await one_round(kind, client, pusher, tensors,
                                                          version, opts, seconds, budget)
                        for error in round_.push_errors[:3]:
                            console.print(f"  failed push: {error}")
                        for error in round_.request_errors:
                            console.print(f"  failed request: {error}")
                        if r > 0:
                            rounds.append(round_)
                        console.print(f"round {r} {kind}: {round_line(round_, opts)}")
                    r += 1


def round_line(round_: Round, opts: argparse.Namespace) -> str:
    """What one round measured, printed as it ends: with the pushes' frozen time and
    replica counts, so a run stopped before its table still shows them."""
    line = (f"{round_.tokens_per_s:.0f} tok/s, {len(round_.push_s)} pushes, "
            f"{len(round_.push_errors)} failed pushes, {round_.num_failed} failed requests")
    if round_.frozen_s:
        line += f", frozen p50 {percentile(round_.frozen_s, 0.5):.3f} s"
    if opts.ray_replicas and round_.num_replicas_loaded:
        loaded = round_.num_replicas_loaded
        line += f", each loaded on {min(loaded)}-{max(loaded)} of {opts.ray_replicas} replicas"
    return line


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def print_report(console: Console, rounds: list[Round], opts: argparse.Namespace) -> None:
    server = (f"Ray Serve, {opts.ray_replicas} replicas" if opts.ray_replicas
              else "standalone service")
    if not rounds:
        console.print("no timed round finished")
        return
    num_rounds = len(rounds) // len(KINDS)
    console.print(f"{opts.model}, {server}, transport {opts.transport}, {opts.concurrency} "
                  f"requests in flight x {opts.max_tokens} tokens, {num_rounds} rounds of "
                  f"{opts.round_s} s per kind, interleaved")
    table = Table("kind", "median tok/s", "range tok/s", "pushes", "failed pushes",
                  "drain p50 s", "frozen p50 s", "frozen p99 s", "push p50 s",
                  "failed requests")
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
                      str(sum(len(r.push_errors) for r in mine)), cell(drains, 0.5),
                      cell(frozen, 0.5), cell(frozen, 0.99), cell(pushes, 0.5),
                      str(sum(r.num_failed for r in mine)))
    console.print(table)
    pairs = [(p.tokens_per_s, q.tokens_per_s) for p, q in
             zip([r for r in rounds if r.kind == "pushing"],
                 [r for r in rounds if r.kind == "quiet"])]
    ratios = [p / q for p, q in pairs]
    console.print(f"pushing / quiet tokens/s: median {statistics.median(ratios):.3f} "
                  f"(range {min(ratios):.3f}-{max(ratios):.3f})")
    loaded = [n for r in rounds for n in r.num_replicas_loaded]
    if opts.ray_replicas and loaded:
        console.print(f"replicas each push loaded on: {min(loaded)} to {max(loaded)} "
                      f"(of {opts.ray_replicas})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded:tiny")
    parser.add_argument("--transport", choices=("shm", "cuda_ipc"), default="shm")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per kind")
    parser.add_argument("--round-s", type=float, default=20.0)
    parser.add_argument("--warmup-s", type=float, default=None,
                        help="each round of the untimed first pair (default: --round-s)")
    parser.add_argument("--num-speculative-tokens", type=int, default=1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="default: cuda when vLLM's platform is CUDA")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                        help="the service's; each Ray Serve replica gets 1/N of it")
    parser.add_argument("--ray-replicas", type=int, default=0, help=(
        "the Ray Serve app with this many engine replicas on the service's share "
        "(transport shm); 0: the standalone service"))
    parser.add_argument("--pushes", type=int, default=0,
                        help="run rounds until the timed ones made this many pushes "
                             "(instead of --rounds)")
    parser.add_argument("--logs", default=None, help="directory for the servers' logs")
    opts = parser.parse_args()
    if opts.round_s <= 0 or (opts.warmup_s is not None and opts.warmup_s <= 0):
        parser.error("--round-s and --warmup-s must be > 0")
    if opts.ray_replicas and opts.transport != "shm":
        # the app refuses cuda_ipc (serve/config.py); its nccl needs the trainer's group,
        # and NCCL puts no two ranks of one group on one GPU
        parser.error("--ray-replicas: the Ray Serve app takes --transport shm here")
    if opts.device is None:  # NVML only: CUDA initialized here would break vLLM's fork
        from vllm.platforms import current_platform

        opts.device = "cuda" if current_platform.is_cuda() else "cpu"
    if opts.warmup_s is None:
        opts.warmup_s = opts.round_s
    console = Console()
    rounds: list[Round] = []
    try:
        asyncio.run(run(opts, console, rounds))
    except KeyboardInterrupt as stop:
        console.print(f"stopped ({str(stop) or 'Ctrl-C'}) after {len(rounds)} timed rounds; "
                      "the report covers those")
    print_report(console, rounds, opts)


if __name__ == "__main__":
    main()
