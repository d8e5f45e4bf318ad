"""The RL demo: two runs from the same weights, drafter synced every step vs never.

Runs in the user's terminal process (``rollout-service rl-demo``), which plays
the trainer (``trainer_client.loop`` on megatron-core, CPU). It starts the
service itself (``ServiceProcess``, embedded tiny model) once per run, so both
runs start from the checkpoint's weights: one run pushes main model and drafter
after every step, the other the main model only. It prints both runs'
acceptance side by side and saves a figure of the macro accept rate per step.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
from rich.table import Table

from rollout_service.config import ServiceConfig
from rollout_service.embedded.corpus import arithmetic_prompts
from rollout_service.tools.launch import ServiceProcess
from rollout_service.tools.plot import LineChart, save_charts
from trainer_client.cli import fmt, print_step
from trainer_client.loop import LoopConfig, StepLog, run_loop

DEMO_WEIGHTS_TOKEN = "trainer-demo-weights-token"
RUNS = {"synced": True, "never synced": False}
"""Run name -> whether the drafter receives every push."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DemoOptions:
    """The knobs of ``rollout-service rl-demo``."""

    num_steps: int = 20
    batch_size: int = 16
    max_tokens: int = 32
    lr: float = 2e-3
    mtp_scaling_factor: float = 1.0
    num_speculative_tokens: int = 2
    seed: int = 0


def run_rl_demo(options: DemoOptions, plot: Path) -> dict[str, list[StepLog]]:
    """Both runs; prints the comparison, writes ``plot`` and its numbers (``.json``)."""
    console = Console()
    workdir = Path(tempfile.mkdtemp(prefix="rl-demo-"))
    checkpoint = Path(ServiceConfig(model="embedded:tiny").resolve_model()[0])
    config = workdir / "service.json"
    config.write_text(json.dumps({
        "model": "embedded:tiny", "weights_token": DEMO_WEIGHTS_TOKEN,
        "mtp": {"num_speculative_tokens": options.num_speculative_tokens}}))
    runs = {}
    for name, sync in RUNS.items():
        cfg = LoopConfig(service_url="", checkpoint=checkpoint, weights_token=DEMO_WEIGHTS_TOKEN,
                         num_steps=options.num_steps, batch_size=options.batch_size,
                         max_tokens=options.max_tokens, lr=options.lr,
                         mtp_scaling_factor=options.mtp_scaling_factor, sync_drafter=sync,
                         seed=options.seed)
        runs[name] = _run(console, name, cfg, config, workdir / f"service-{int(sync)}.log")
    _print_comparison(console, runs)
    numbers = plot.with_suffix(".json")
    numbers.write_text(json.dumps({name: [dataclasses.asdict(r) for r in logs]
                                   for name, logs in runs.items()}, indent=1))
    save_charts([accept_rate_chart(runs)], plot)
    console.print(f"plot: {plot.resolve()}  numbers: {numbers.resolve()}")
    return runs


def _run(console: Console, name: str, cfg: LoopConfig, config: Path,
         log_path: Path) -> list[StepLog]:
    """Start a fresh service, run the loop against it, stop it."""
    with ServiceProcess(log_path, config=config) as service:
        with console.status(f"[{name}] starting the service (log: {log_path})"):
            service.wait_healthy(timeout_s=600)
        cfg = dataclasses.replace(cfg, service_url=service.url)
        columns = (*Progress.get_default_columns()[:1], BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn())
        with Progress(*columns, console=console) as progress:
            task = progress.add_task(f"[{name}] training", total=cfg.num_steps)

            def log(entry: StepLog) -> None:
                print_step(console, entry)
                progress.advance(task)

            return run_loop(cfg, arithmetic_prompts, log=log)


def _print_comparison(console: Console, runs: dict[str, list[StepLog]]) -> None:
    names = list(runs)
    table = Table("step", *(f"accept ({n})" for n in names), *(f"reward ({n})" for n in names),
                  *(f"mtp_1 ({n})" for n in names), title="macro accept rate per step")
    for step in range(max(len(r) for r in runs.values())):
        rows = [runs[n][step] for n in names]
        table.add_row(str(step), *(fmt(r.macro_accept_rate) for r in rows),
                      *(fmt(r.mean_reward) for r in rows),
                      *(fmt(r.mtp_losses[0]) for r in rows))
    console.print(table)
    for n in names:
        rates = [r.macro_accept_rate for r in runs[n] if r.macro_accept_rate is not None]
        tail = rates[-5:]
        console.print(f"{n}: first {fmt(rates[0] if rates else None)}, "
                      f"last {fmt(rates[-1] if rates else None)}, "
                      f"mean of last 5 {fmt(sum(tail) / len(tail) if tail else None)}, "
                      f"mean step {sum(r.step_s for r in runs[n]) / len(runs[n]):.2f} s")


def accept_rate_chart(runs: dict[str, list[StepLog]]) -> LineChart:
    """Macro accept rate per step, one line per run."""
    series = {f"drafter {name}": [(r.step, r.macro_accept_rate) for r in logs
                                  if r.macro_accept_rate is not None]
              for name, logs in runs.items()}
    return LineChart(title="MTP drafter acceptance during RL (embedded tiny model)",
                     xlabel="training step (rollout served by the previous step's weights)",
                     ylabel="macro accept rate (mean over requests)", series=series,
                     y_range=(0.0, 1.05), integer_x=True)
