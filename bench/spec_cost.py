"""What speculation costs: the engine's measured verify cost ratio against end-to-end
throughput with and without drafts.

Runs vLLM engines one after another in this process (``AsyncLLM`` through the service's
own ``start_engine``): one without speculation, then one per ``k``. Each generates the
same batches (``--batch`` concurrent sequences of ``--tokens`` tokens, ``ignore_eos``)
greedily and at temperature 1, the order of the rounds alternating, and reports:

- tokens/s, the micro accept length (tokens per verify step);
- the cost ratio the engine measured at start-up (``engines/vllm/step_cost.py``);
- the ratio the throughputs imply: ``accept length * tokens/s without / tokens/s with``
  (what a verify step must have cost for the measured speed), and the net speed-up
  both ways.

    python -m bench.spec_cost --ks 1,2 --batch 8 --tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
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


async def _throughput(engine: Engine, prompts: list[str], *, batch: int, tokens: int,
                      temperature: float, rounds: int) -> tuple[float, float | None]:
    rates, stats = [], []
    for round_ in range(rounds):
        for start in range(0, len(prompts), batch):
            chunk = prompts[start:start + batch]
            t0 = time.perf_counter()
            results = await asyncio.gather(*(
                engine.generate(p, SamplingOptions(max_tokens=tokens, temperature=temperature,
                                                   seed=i, ignore_eos=True),
                                f"b{round_}-{start}-{i}-{temperature}")
                for i, p in enumerate(chunk)))
            rates.append(sum(len(r.token_ids) for r in results) / (time.perf_counter() - t0))
            stats += [r.spec_decode for r in results]
    summary = summarize(stats)
    length = summary.micro_accept_length if summary.num_with_speculation else None
    return statistics.median(rates), length


async def measure(ks: list[int], *, batch: int, tokens: int, rounds: int,
                  model: str) -> list[Run]:
    prompts = [p for p, _ in arithmetic_prompts(4 * batch, seed=3)]
    runs = []
    for k in [0, *ks]:
        config = ServiceConfig(model=model, mtp={"enabled": k > 0,
                                                 "num_speculative_tokens": max(k, 1)},
                               telemetry={"verify_cost_batch_size": batch})
        engine = await start_engine(config)
        try:
            for temperature in (0.0, 1.0):
                tps, length = await _throughput(engine, prompts, batch=batch, tokens=tokens,
                                                temperature=temperature, rounds=rounds)
                runs.append(Run(k=k, temperature=temperature, tokens_per_s=tps,
                                accept_length=length,
                                measured_ratio=engine.info.verify_cost_ratio))
        finally:
            await engine.shutdown()
    return runs


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
