"""Where the K = 0 floor goes: one engine without speculation and one speculating engine
held at K = 0, the same batches on both, the last round under vLLM's own torch profiler,
their GPU kernels summed per generated token side by side.

The issue's benchmark (docs/speculation-benchmark.md) measures the floor: the controlled
engine pinned at K = 0 ran at 0.80-0.96x spec-off on an H100, lowest at 256 requests,
with the drafter skipped. Throughput says how much, not where. This script starts both
engines in its own process (``start_engine``, as ``bench.spec_cost`` does), pins the
speculating one to K = 0 at every batch size (``apply_spec_schedule``), and per round, in
alternating order, times one batch of ``--batch`` sequences of ``--tokens`` tokens on each
(``ignore_eos``, temperature 1). Its last round runs under vLLM's torch profiler
(``profiler_config``; ``VLLMEngine.profiled``). From each engine's worker trace it sums the
GPU kernels (``cat: kernel``; a CPU engine has none, and then its top-level CPU ops count)
by name per generated token, and prints the largest differences, the totals, and the share
of the profiled span that the kernels kept the device busy: an engine bound by its CPU
leaves the GPU idle between steps.

    python -m bench.step_profile --model embedded:1b --batch 256 --tokens 128 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.engine_options import add_device_arguments, resolve_device
from bench.spec_cost import timed_batches
from bench.spread import median_spread
from rollout_service.config import ServiceConfig
from rollout_service.embedded.corpus import arithmetic_prompts
from rollout_service.engines.base import Engine
from rollout_service.engines.vllm.engine import VLLMEngine
from rollout_service.local import start_engine

MODES = ("spec-off", "k=0")


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceSummary:
    """One engine's profiled round: its device time per operation name."""

    category: str
    """``kernel`` (GPU kernels), or ``cpu_op`` (top-level CPU ops, for a CPU engine)."""
    time_us: dict[str, float]
    """Per name, the summed duration (microseconds)."""
    calls: dict[str, int]
    busy_us: float
    """The union of those events' intervals: time the device was doing any of them."""
    span_us: float
    """From the first such event's start to the last one's end."""


def _events(trace: dict[str, Any], category: str) -> list[dict[str, Any]]:
    return [e for e in trace.get("traceEvents", [])
            if e.get("ph") == "X" and e.get("cat") == category and "dur" in e]


def _top_level(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events not inside another one of their thread (CPU ops nest)."""
    out, end_of = [], {}
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        thread = (e.get("pid"), e.get("tid"))
        if e["ts"] >= end_of.get(thread, float("-inf")):
            out.append(e)
            end_of[thread] = e["ts"] + e["dur"]
    return out


def summarize_trace(trace: dict[str, Any]) -> TraceSummary:
    """The kernels of a torch profiler trace (Chrome format) by name, or, where it holds
    none, its top-level CPU ops.

    Raises:
        ValueError: the trace holds neither.
    """
    category, events = "kernel", _events(trace, "kernel")
    if not events:
        category, events = "cpu_op", _top_level(_events(trace, "cpu_op"))
    if not events:
        raise ValueError("the trace has no kernel and no cpu_op events: was the profiler on "
                         "during a step?")
    time_us: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    for e in events:
        time_us[e["name"]] += float(e["dur"])
        calls[e["name"]] += 1
    busy, reach = 0.0, float("-inf")
    for e in sorted(events, key=lambda e: e["ts"]):
        start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    first = min(float(e["ts"]) for e in events)
    return TraceSummary(category=category, time_us=dict(time_us), calls=dict(calls),
                        busy_us=busy, span_us=reach - first)


def read_trace(directory: Path) -> TraceSummary:
    """The summary of the one worker trace vLLM wrote under ``directory``.

    Raises:
        ValueError: no trace, or several (one engine, one worker, one profiled round).
    """
    traces = sorted(directory.rglob("*.pt.trace.json*"))
    if len(traces) != 1:
        raise ValueError(f"{directory}: expected one worker trace, found {len(traces)}: "
                         f"{[t.name for t in traces]}")
    opener = gzip.open if traces[0].suffix == ".gz" else open
    with opener(traces[0], "rt") as f:
        return summarize_trace(json.load(f))


def comparison(off: TraceSummary, k0: TraceSummary, *, tokens: int, top: int) -> Table:
    """Per name, microseconds per generated token on each engine, the ``top`` largest
    differences first, then the totals and the busy share."""
    names = set(off.time_us) | set(k0.time_us)
    per_token = {n: (off.time_us.get(n, 0.0) / tokens, k0.time_us.get(n, 0.0) / tokens)
                 for n in names}
    table = Table("name", "spec-off us/token", "k=0 us/token", "k=0 - spec-off",
                  "calls (spec-off, k=0)",
                  title=f"{off.category} time per generated token, the {top} largest "
                        f"differences ({tokens} tokens each)")
    for name in sorted(names, key=lambda n: -abs(per_token[n][1] - per_token[n][0]))[:top]:
        a, b = per_token[name]
        table.add_row(name[:90], f"{a:.2f}", f"{b:.2f}", f"{b - a:+.2f}",
                      f"{off.calls.get(name, 0)}, {k0.calls.get(name, 0)}")
    total_off, total_k0 = (sum(s.time_us.values()) / tokens for s in (off, k0))
    table.add_row("all", f"{total_off:.2f}", f"{total_k0:.2f}",
                  f"{total_k0 - total_off:+.2f}", f"{sum(off.calls.values())}, "
                  f"{sum(k0.calls.values())}", end_section=True)
    table.add_row("busy share of the span", f"{off.busy_us / off.span_us:.3f}",
                  f"{k0.busy_us / k0.span_us:.3f}", "", "")
    table.add_row("span us/token", f"{off.span_us / tokens:.2f}",
                  f"{k0.span_us / tokens:.2f}", f"{(k0.span_us - off.span_us) / tokens:+.2f}",
                  "")
    return table


def config(opts: argparse.Namespace, mode: str, profile_dir: Path) -> ServiceConfig:
    """``spec-off`` (no drafter) or ``k=0`` (the controlled engine's start-up: every K's
    graphs, the drafter at K = 0 as ``--drafter-at-k0`` says; K pinned after start)."""
    kwargs: dict[str, Any] = {"profiler_config": {
        "profiler": "torch", "torch_profiler_dir": str(profile_dir.resolve()),
        "ignore_frontend": True, "torch_profiler_with_stack": False}}
    if opts.device == "cuda":  # vLLM's GPU defaults, as bench.speculation's engines run,
        # not the embedded model's CPU ones (eager, a 512 MiB cache, 1024 tokens)
        kwargs |= {"dtype": "bfloat16", "enforce_eager": opts.eager,
                   "kv_cache_memory_bytes": None, "max_model_len": None,
                   "gpu_memory_utilization": opts.gpu_memory_utilization}
        if opts.max_capture_tokens is not None:
            kwargs["compilation_config"] = {"max_cudagraph_capture_size": opts.max_capture_tokens}
    overrides: dict[str, Any] = {"mtp": {"enabled": False}}
    if mode == "k=0":
        overrides = {"mtp": {"num_speculative_tokens": opts.k_max},
                     "speculation_control": {"enabled": True,
                                             "drafter_at_k0": opts.drafter_at_k0}}
    return ServiceConfig(model=opts.model, engine_kwargs=kwargs, **overrides)


async def one_batch(engine: Engine, prompts: list[str], tokens: int, tag: str) -> float:
    """Seconds for every prompt at once, ``tokens`` each (temperature 1)."""
    seconds, _ = await timed_batches(engine, prompts, batch=len(prompts), tokens=tokens,
                                     temperature=1.0, tag=tag)
    return seconds


async def run(opts: argparse.Namespace, console: Console) -> None:
    prompts = [p for p, _ in arithmetic_prompts(opts.batch, seed=5)]
    out = Path(opts.profile_dir)
    engines: dict[str, VLLMEngine] = {}
    try:
        for mode in MODES:
            engine = await start_engine(config(opts, mode, out / mode))
            assert isinstance(engine, VLLMEngine), type(engine)
            engines[mode] = engine
        pinned = await engines["k=0"].apply_spec_schedule({1: 0})
        console.print(f"k=0 engine's schedule: {pinned} (drafter at K = 0: "
                      f"{'skipped' if engines['k=0'].skips_drafter_at_k0 else 'run'})")
        for mode, engine in engines.items():  # warm-up: every batch shape once
            await one_batch(engine, prompts, opts.tokens, f"warm-{mode}")
        seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
        for r in range(opts.rounds):
            order = MODES if r % 2 == 0 else MODES[::-1]
            for mode in order:
                seconds[mode].append(await one_batch(engines[mode], prompts, opts.tokens,
                                                     f"r{r}-{mode}"))
        for mode in MODES:  # the profiled round, after the timed ones
            async with engines[mode].profiled():
                await one_batch(engines[mode], prompts, opts.tokens, f"profiled-{mode}")
    finally:
        for engine in engines.values():
            await engine.shutdown()
    tokens = opts.batch * opts.tokens
    ratios = [o / k for o, k in zip(seconds["spec-off"], seconds["k=0"], strict=True)]
    console.print(f"{opts.batch} sequences x {opts.tokens} tokens, {opts.rounds} rounds: "
                  + ", ".join(f"{m} {tokens / statistics.median(s):.0f} tok/s"
                              for m, s in seconds.items())
                  + f"; k=0 / spec-off per round {median_spread(ratios)}")
    console.print(comparison(read_trace(out / "spec-off"), read_trace(out / "k=0"),
                             tokens=tokens, top=opts.top))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded:tiny")
    parser.add_argument("--batch", type=int, default=256, help="sequences at once")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (unprofiled)")
    parser.add_argument("--k-max", type=int, default=3)
    parser.add_argument("--drafter-at-k0", choices=("auto", "skip", "run"), default="auto")
    parser.add_argument("--max-capture-tokens", type=int, default=None,
                        help="CUDA: max_cudagraph_capture_size for both engines")
    parser.add_argument("--top", type=int, default=25, help="names in the table")
    parser.add_argument("--profile-dir", default="bench-step-profile",
                        help="where vLLM writes each engine's trace (must not hold old ones)")
    add_device_arguments(parser, gpu_memory_utilization=0.3, engines="two engines")
    opts = parser.parse_args()
    resolve_device(opts)
    asyncio.run(run(opts, Console(width=200)))


if __name__ == "__main__":
    main()
