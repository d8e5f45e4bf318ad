"""``trainer-client`` command line: ``loop`` against a running service, and ``demo``.

``loop`` runs in this process against a service started elsewhere. ``demo`` starts
the service itself (``ServiceProcess``, embedded tiny model) twice, once per run, so
that both runs start from the same weights: one run pushes every step to main and
drafter, the other to main only; it prints both runs' acceptance side by side and
plots them.

    python -m trainer_client.cli demo --steps 20
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
from rich.table import Table

if TYPE_CHECKING:
    from trainer_client.loop import LoopConfig, StepLog

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Megatron trainer client: RL loop with MTP loss and weight pushes.")

DEMO_WEIGHTS_TOKEN = "trainer-demo-weights-token"


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _print_step(console: Console, entry: StepLog) -> None:
    mtp = " ".join(f"{v:.3f}" for v in entry.mtp_losses)
    console.print(f"step {entry.step:3d} loss {entry.main_loss:+.3f} mtp [{mtp}] "
                  f"reward {entry.mean_reward:.2f} accept {_fmt(entry.macro_accept_rate)} "
                  f"v{entry.weight_version} push {entry.push_s:.2f}s step {entry.step_s:.1f}s",
                  soft_wrap=True)


@app.command()
def loop(
    service_url: Annotated[str, typer.Option(help="Rollout service URL.")],
    checkpoint: Annotated[Path, typer.Option(help="Checkpoint directory the service serves.")],
    weights_token: Annotated[str, typer.Option(envvar="ROLLOUT_WEIGHTS_TOKEN",
                                               help="The service's weights token.")],
    api_key: Annotated[Optional[str], typer.Option(envvar="ROLLOUT_API_KEY",
                                                   help="Generation API key.")] = None,
    num_steps: Annotated[int, typer.Option(help="Optimizer steps.")] = 20,
    batch_size: Annotated[int, typer.Option(help="Prompts per step.")] = 16,
    max_tokens: Annotated[int, typer.Option(help="Tokens per sample.")] = 32,
    temperature: Annotated[float, typer.Option(help="Sampling temperature.")] = 1.0,
    lr: Annotated[float, typer.Option(help="Adam learning rate.")] = 2e-3,
    mtp_scaling_factor: Annotated[float, typer.Option(help="MTP loss weight.")] = 1.0,
    sync_drafter: Annotated[bool, typer.Option(help="Push to main and drafter.")] = True,
    seed: Annotated[int, typer.Option(help="Torch and prompt seed.")] = 0,
) -> None:
    """Run the RL loop against a running service."""
    from trainer_client.loop import LoopConfig, run_loop

    try:
        cfg = LoopConfig(service_url=service_url, checkpoint=checkpoint,
                         weights_token=weights_token, api_key=api_key, num_steps=num_steps,
                         batch_size=batch_size, max_tokens=max_tokens, temperature=temperature,
                         lr=lr, mtp_scaling_factor=mtp_scaling_factor,
                         sync_drafter=sync_drafter, seed=seed)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    console = Console()
    run_loop(cfg, log=lambda entry: _print_step(console, entry))


@app.command()
def demo(
    steps: Annotated[int, typer.Option(help="Steps per run.")] = 20,
    batch_size: Annotated[int, typer.Option(help="Prompts per step.")] = 16,
    max_tokens: Annotated[int, typer.Option(help="Tokens per sample.")] = 32,
    lr: Annotated[float, typer.Option(help="Adam learning rate.")] = 2e-3,
    mtp_scaling_factor: Annotated[float, typer.Option(help="MTP loss weight.")] = 1.0,
    num_speculative_tokens: Annotated[int, typer.Option(help="Draft tokens per step.")] = 2,
    seed: Annotated[int, typer.Option(help="Torch and prompt seed.")] = 0,
    plot: Annotated[Path, typer.Option(help="Where the PNG goes.")] = Path("mtp-demo.png"),
) -> None:
    """Two runs from the same weights: drafter synced every step vs never; compare."""
    from trainer_client.loop import LoopConfig

    console = Console()
    workdir = Path(tempfile.mkdtemp(prefix="trainer-demo-"))
    checkpoint = _checkpoint("embedded:tiny")
    config = workdir / "service.json"
    config.write_text(json.dumps({
        "model": "embedded:tiny", "weights_token": DEMO_WEIGHTS_TOKEN,
        "mtp": {"num_speculative_tokens": num_speculative_tokens}}))
    runs = {}
    for sync in (True, False):
        name = "synced" if sync else "never synced"
        cfg_kwargs = dict(checkpoint=checkpoint, weights_token=DEMO_WEIGHTS_TOKEN,
                          num_steps=steps, batch_size=batch_size, max_tokens=max_tokens,
                          lr=lr, mtp_scaling_factor=mtp_scaling_factor, sync_drafter=sync,
                          seed=seed)
        # A fresh service per run: both runs start from the checkpoint's weights.
        runs[name] = _demo_run(console, name, config, workdir / f"service-{int(sync)}.log",
                               lambda url, kw=cfg_kwargs: LoopConfig(service_url=url, **kw))
    _print_comparison(console, runs)
    numbers = plot.with_suffix(".json")
    numbers.write_text(json.dumps({name: [dataclasses.asdict(r) for r in logs]
                                   for name, logs in runs.items()}, indent=1))
    console.print(f"plot: {_save_plot(runs, plot).resolve()}  numbers: {numbers.resolve()}")


def _checkpoint(model: str) -> Path:
    from rollout_service.config import ServiceConfig

    return Path(ServiceConfig(model=model).resolve_model()[0])


def _demo_run(console: Console, name: str, config: Path, log_path: Path,
              make_cfg: Callable[[str], LoopConfig]) -> list[StepLog]:
    """Start a fresh service, run the loop against it, stop it."""
    from rollout_service.launch import ServiceProcess
    from trainer_client.loop import run_loop

    with ServiceProcess(log_path, config=config) as service:
        with console.status(f"[{name}] starting the service (log: {log_path})"):
            service.wait_healthy(timeout_s=600)
        cfg = make_cfg(service.url)
        columns = (*Progress.get_default_columns()[:1], BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn())
        with Progress(*columns, console=console) as progress:
            task = progress.add_task(f"[{name}] training", total=cfg.num_steps)

            def log(entry: StepLog) -> None:
                _print_step(console, entry)
                progress.advance(task)

            return run_loop(cfg, log=log)


def _print_comparison(console: Console, runs: dict[str, list[StepLog]]) -> None:
    names = list(runs)
    table = Table("step", *(f"accept ({n})" for n in names), *(f"reward ({n})" for n in names),
                  *(f"mtp_1 ({n})" for n in names), title="macro accept rate per step")
    for step in range(max(len(r) for r in runs.values())):
        rows = [runs[n][step] for n in names]
        table.add_row(str(step), *(_fmt(r.macro_accept_rate) for r in rows),
                      *(_fmt(r.mean_reward) for r in rows),
                      *(_fmt(r.mtp_losses[0]) for r in rows))
    console.print(table)
    for n in names:
        rates = [r.macro_accept_rate for r in runs[n] if r.macro_accept_rate is not None]
        tail = rates[-5:]
        console.print(f"{n}: first {_fmt(rates[0] if rates else None)}, "
                      f"last {_fmt(rates[-1] if rates else None)}, "
                      f"mean of last 5 {_fmt(sum(tail) / len(tail) if tail else None)}, "
                      f"mean step {sum(r.step_s for r in runs[n]) / len(runs[n]):.2f} s")


def _save_plot(runs: dict[str, list[StepLog]], path: Path) -> Path:
    """Macro accept rate per step, one line per run."""
    from rollout_service.plot import line_chart, save_stacked

    series = {f"drafter {name}": [(r.step, r.macro_accept_rate) for r in logs
                                  if r.macro_accept_rate is not None]
              for name, logs in runs.items()}
    chart = line_chart(series, title="macro accept rate of the MTP drafter",
                       xlabel="step (rollout with previous weights)", y_range=(0.0, 1.05))
    return save_stacked([chart], path)


if __name__ == "__main__":
    app()
