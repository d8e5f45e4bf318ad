"""What the speculation controller costs the service's event loop per finished sequence.

The service calls ``SpeculationControl.observe`` with every finished sequence, in the
event loop that also runs vLLM's output handler (``AsyncLLM``) and every HTTP request: a
rollout of 512 sequences pays it 512 times, and what it costs there is time the loop does
not spend relaying tokens. This script times that call without a GPU and without an
engine: a FAKE schedule engine (it records the schedules it is sent and infers nothing)
behind the real ``SpeculationControl``, the service config's default buckets, K = 3, a
cost table filled as the start-up calibration fills it (every K at every bucket edge,
``num_steps_per_cost_sample`` steps each) and sequences shaped as vLLM reports them
(drafts at K = 3, a per-position histogram of length 3), their acceptance varying so the
decisions move.

Each measurement runs in a process of its own; with ``--baseline REV`` a second one runs
the same measurement on the code of commit ``REV`` (a git worktree, ``bench.baseline``),
the two in alternating order round by round. The table: microseconds per observed
sequence, median (min - max) over rounds, and the ratio to the baseline per round.

    python -m bench.controller_cost --rounds 7 --baseline HEAD~1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

K_MAX = 3
STEPS_PER_POINT = 16
"""Steps per (K, bucket edge) fed to the table: the default ``num_steps_per_cost_sample``."""


def sequence_stats(index: int) -> Any:  # -> SpecDecodeStats (imported late: see measure)
    """A finished sequence as vLLM reports it: 40-120 drafts at K = 3, acceptance 0.3-0.8
    at the first position and falling by position."""
    from rollout_service.protocol.acceptance import SpecDecodeStats

    num_drafts = 40 + (index * 37) % 81
    rate = 0.3 + 0.5 * ((index * 13) % 11) / 10
    accepted = [int(num_drafts * rate ** (p + 1)) for p in range(K_MAX)]
    reached = [num_drafts, *accepted[:-1]]
    return SpecDecodeStats(num_drafts=num_drafts, num_draft_tokens=K_MAX * num_drafts,
                           num_accepted_tokens=sum(accepted), num_verify_steps=num_drafts,
                           accepted_per_position=tuple(accepted),
                           reached_per_position=tuple(reached),
                           drafts_per_k=(0,) * K_MAX + (num_drafts,))


CHUNK = 100
"""Sequences timed together; a measurement is the median of its chunks (a chunk that
another process's burst on the machine slowed does not move it)."""


class FakeScheduleEngine:
    """A FAKE engine: takes every schedule, runs nothing; :func:`loaded_control` feeds its
    step-cost sinks by hand."""

    batch_size = 256
    skips_drafter_at_k0 = False

    def __init__(self) -> None:
        from rollout_service.engines.base import EngineInfo

        self.info = EngineInfo(model="m", engine="fake", model_path="", max_model_len=4096,
                               vocab_size=1000, num_speculative_tokens=K_MAX,
                               speculative_method="mtp", has_pushable_drafter=True)
        self.sinks: list[Callable[[Any], None]] = []

    async def apply_spec_schedule(self, schedule: Mapping[int, int]) -> dict[int, int]:
        return dict(schedule)

    def subscribe_step_costs(self, sink: Callable[[Any], None]) -> None:
        self.sinks.append(sink)


async def loaded_control() -> Any:  # -> SpeculationControl (imported late: see measure)
    """The service's ``SpeculationControl`` on a :class:`FakeScheduleEngine`, started, its
    cost table filled as the calibration fills it."""
    from prometheus_client import CollectorRegistry

    from rollout_service.config import SpeculationControlSettings
    from rollout_service.spec_control import REASONS, SpeculationControl
    from rollout_service.speculation.acceptance import WeightVersions
    from rollout_service.speculation.cost import StepCostSample
    from rollout_service.telemetry.speculation import SpeculationMetrics

    settings = SpeculationControlSettings(enabled=True, calibration={"enabled": False})
    buckets = list(settings.batch_size_buckets)
    engine = FakeScheduleEngine()
    metrics = SpeculationMetrics(registry=CollectorRegistry(), model="m", engine="fake",
                                 buckets=buckets, reasons=REASONS)
    control = SpeculationControl(engine, settings,  # type: ignore[arg-type]
                                 lambda: WeightVersions(main_version=1, draft_version=1),
                                 metrics)
    await control.start()
    for k in range(K_MAX + 1):
        for b in buckets:
            for step in range(STEPS_PER_POINT):
                step_s = (0.008 + 0.00004 * b) * (1 + 0.08 * k) * (1 + 0.01 * (step % 3))
                for sink in engine.sinks:
                    sink(StepCostSample(k=k, batch_size=b, step_s=step_s))
    return control


def finished(num_sequences: int) -> list[Any]:  # -> list[GenerationResult]
    """``num_sequences`` finished sequences (:func:`sequence_stats`)."""
    from rollout_service.engines.base import GenerationResult

    return [GenerationResult(prompt_token_ids=(1,), token_ids=(2,), text="",
                             finish_reason="length", logprobs=None, weight_versions=(),
                             spec_decode=sequence_stats(i)) for i in range(num_sequences)]


def measure(num_sequences: int) -> float:
    """Microseconds per ``SpeculationControl.observe``, the median over chunks of
    :data:`CHUNK` of ``num_sequences`` sequences, after as many untimed ones, on the code
    this process imports (every import of the service is inside the functions, so a
    process whose ``PYTHONPATH`` names another tree measures that tree's code)."""

    async def run() -> float:
        control = await loaded_control()
        results = finished(2 * num_sequences)
        for result in results[:num_sequences]:
            control.observe(result)
        chunks = []
        for at in range(num_sequences, 2 * num_sequences, CHUNK):
            chunk = results[at:at + CHUNK]
            start = time.perf_counter()
            for result in chunk:
                control.observe(result)
            chunks.append((time.perf_counter() - start) / len(chunk))
        await control.settle()
        return 1e6 * statistics.median(chunks)

    return asyncio.run(run())


def measured_in(tree: Path, num_sequences: int) -> float:
    """``measure`` in a process that imports the service from ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--measure",
                          str(num_sequences)], env=env, cwd=tree, check=True,
                         capture_output=True, text=True).stdout
    return float(json.loads(out.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--sequences", type=int, default=2000,
                        help="timed sequences per measurement")
    parser.add_argument("--baseline", metavar="REV", default=None,
                        help="also measure the code at git commit REV")
    parser.add_argument("--measure", type=int, default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.measure is not None:  # a measuring child: one number out
        print(json.dumps(measure(opts.measure)))
        return

    from rich.console import Console
    from rich.table import Table

    from bench.baseline import REPO, worktree
    from bench.spread import median_spread

    with TemporaryDirectory() as scratch, worktree(opts.baseline, Path(scratch)) as base:
        trees = {"this tree": REPO, **({f"baseline {opts.baseline}": base} if base else {})}
        names = list(trees)
        per_round: list[dict[str, float]] = []
        for r in range(opts.rounds):
            order = names if r % 2 == 0 else names[::-1]
            per_round.append({name: measured_in(trees[name], opts.sequences)
                              for name in order})
            print(f"  round {r + 1}: " + ", ".join(f"{n} {per_round[-1][n]:.1f} us"
                                                   for n in names), flush=True)
    table = Table("code", "us per observed sequence", "x 512 sequences (ms)",
                  "ratio to the baseline, per round")
    for name in names:
        values = [m[name] for m in per_round]
        ratio = ([m[name] / m[names[1]] for m in per_round]
                 if len(names) > 1 and name != names[1] else [])
        table.add_row(name, median_spread(values, "{:.1f}"),
                      median_spread([v * 512 / 1e3 for v in values], "{:.1f}"),
                      median_spread(ratio, "{:.3f}") if ratio else "-")
    console = Console(width=140)
    console.print(f"SpeculationControl.observe, K = {K_MAX}, the default buckets, a FAKE "
                  f"engine; {opts.sequences} sequences a measurement, {opts.rounds} rounds")
    console.print(table)


if __name__ == "__main__":
    main()
