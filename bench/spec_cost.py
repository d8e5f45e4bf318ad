"""What speculation costs: the engine's measured verify cost ratio against end-to-end
throughput with and without drafts.

Starts vLLM engines in this process (``AsyncLLM`` through the service's own
``start_engine``): one without speculation and one per ``k``, all up at once. Then, round
after round, each engine in turn generates the same batches (``--batch`` concurrent
sequences of ``--tokens`` tokens, ``ignore_eos``), greedily and at temperature 1, so drift
in the host's load hits every engine alike. It reports:

- tokens/s, the micro accept length (tokens per verify step);
- the cost ratio the engine measured at start-up (``engines/vllm/verify_cost.py``);
- the ratio the throughputs imply: ``accept length * tokens/s without / tokens/s with``
  (what a verify step must have cost for the measured speed), and the net speed-up
  both ways.

    python -m bench.spec_cost --ks 1,2 --batch 8 --tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from rollout_service.config import ServiceConfig
from rollout_service.embedded.corpus import arithmetic_prompts
from rollout_service.engines.base import Engine, SamplingOptions
from rollout_service.local import start_engine
from rollout_service.protocol.acceptance import summarize


@dataclass(frozen=True, kw_only=True, slots=True)
class Run:
    k: int
    temperature: float
    tokens_per_s: float
    accept_length: float | None
    measured_ratio: float | None


async def timed_batches(engine: Engine, prompts: list[str], *, batch: int, tokens: int,
                   temperature: float, tag: str) -> tuple[float, list]:
    """Seconds and results of generating every prompt, ``batch`` at a time."""
    seconds, results = 0.0, []
    for start in range(0, len(prompts), batch):
        t0 = time.perf_counter()
        results += await asyncio.gather(*(
            engine.generate(p, SamplingOptions(max_tokens=tokens, temperature=temperature,
                                               seed=i, ignore_eos=True), f"{tag}-{start}-{i}")
            for i, p in enumerate(prompts[start:start + batch])))
        seconds += time.perf_counter() - t0
    return seconds, results


async def measure(ks: list[int], *, batch: int, tokens: int, rounds: int,
                  model: str) -> list[Run]:
    prompts = [p for p, _ in arithmetic_prompts(4 * batch, seed=3)]
    engines: dict[int, Engine] = {}
    try:
        for k in [0, *ks]:
            engines[k] = await start_engine(ServiceConfig(
                model=model, mtp={"enabled": k > 0, "num_speculative_tokens": max(k, 1)},
                telemetry={"verify_cost_batch_size": batch}))
        seconds: dict[tuple[int, float], float] = {}
        stats: dict[tuple[int, float], list] = {}
        for round_ in range(rounds):
            for temperature in (0.0, 1.0):
                for k, engine in engines.items():
                    took, results = await timed_batches(engine, prompts, batch=batch,
                                                   tokens=tokens, temperature=temperature,
                                                   tag=f"{round_}-{temperature}")
                    seconds[k, temperature] = seconds.get((k, temperature), 0.0) + took
                    stats.setdefault((k, temperature), []).extend(
                        r.spec_decode for r in results)
        num_tokens = rounds * len(prompts) * tokens
        runs = []
        for (k, temperature), took in seconds.items():
            summary = summarize(stats[k, temperature])
            runs.append(Run(k=k, temperature=temperature, tokens_per_s=num_tokens / took,
                            accept_length=summary.micro_accept_length
                            if summary.num_with_speculation else None,
                            measured_ratio=engines[k].info.verify_cost_ratio))
        return sorted(runs, key=lambda r: (r.k, r.temperature))
    finally:
        for engine in engines.values():
            await engine.shutdown()


def table(runs: list[Run]) -> Table:
    plain = {r.temperature: r.tokens_per_s for r in runs if r.k == 0}
    out = Table("k", "temperature", "tokens/s", "accept length", "measured ratio",
                "implied ratio", "net speed-up (estimate)", "net speed-up (measured)")
    for r in runs:
        if r.k == 0:
            out.add_row("0", f"{r.temperature:g}", f"{r.tokens_per_s:.0f}", "", "", "", "", "1")
            continue
        speedup = r.tokens_per_s / plain[r.temperature]
        implied = r.accept_length / speedup if r.accept_length else None
        estimate = (r.accept_length / r.measured_ratio
                    if r.accept_length and r.measured_ratio else None)
        out.add_row(str(r.k), f"{r.temperature:g}", f"{r.tokens_per_s:.0f}",
                    f"{r.accept_length:.2f}" if r.accept_length else "-",
                    f"{r.measured_ratio:.2f}" if r.measured_ratio else "-",
                    f"{implied:.2f}" if implied else "-",
                    f"{estimate:.2f}" if estimate else "-", f"{speedup:.2f}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ks", default="1,2", help="draft tokens per step, comma-separated")
    parser.add_argument("--batch", type=int, default=8, help="concurrent sequences")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default="embedded:tiny")
    args = parser.parse_args()
    runs = asyncio.run(measure([int(k) for k in args.ks.split(",")], batch=args.batch,
                               tokens=args.tokens, rounds=args.rounds, model=args.model))
    Console().print(table(runs))


if __name__ == "__main__":
    main()
