"""``trainer-client`` command line: ``loop`` against a running rollout service.

Runs the RL loop in this process against a service started elsewhere, with
prompts from a JSONL file. The two-run demo (drafter synced vs never) is
``rollout-service rl-demo``, which starts the service itself.

    trainer-client loop --service-url http://127.0.0.1:8000 --checkpoint DIR \
        --prompts prompts.jsonl
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console

if TYPE_CHECKING:
    from trainer_client.loop import StepLog

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Megatron trainer client: RL loop with MTP loss and weight pushes.")


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def print_step(console: Console, entry: StepLog) -> None:
    """One line per step: losses, reward, acceptance, version, push and step time."""
    mtp = " ".join(f"{v:.3f}" for v in entry.mtp_losses)
    accuracy = " ".join(f"{v:.3f}" for v in entry.mtp_accuracy)
    console.print(f"step {entry.step:3d} loss {entry.main_loss:+.3f} mtp [{mtp}] "
                  f"mtp top-1 [{accuracy}] "
                  f"reward {entry.mean_reward:.2f} accept {fmt(entry.macro_accept_rate)} "
                  f"v{entry.weight_version} push {entry.push_s:.2f}s step {entry.step_s:.1f}s",
                  soft_wrap=True)


@app.command()
def loop(
    service_url: Annotated[str, typer.Option(help="Rollout service URL.")],
    checkpoint: Annotated[Path, typer.Option(help="Checkpoint directory the service serves.")],
    prompts: Annotated[Path, typer.Option(
        help='JSONL file of {"prompt": ..., "answer": ...} lines (the toy reward checks '
             "the answer).")],
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
    from trainer_client.task import jsonl_prompts

    try:
        source = jsonl_prompts(prompts)
        cfg = LoopConfig(service_url=service_url, checkpoint=checkpoint,
                         weights_token=weights_token, api_key=api_key, num_steps=num_steps,
                         batch_size=batch_size, max_tokens=max_tokens, temperature=temperature,
                         lr=lr, mtp_scaling_factor=mtp_scaling_factor,
                         sync_drafter=sync_drafter, seed=seed)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    console = Console()
    run_loop(cfg, source, log=lambda entry: print_step(console, entry))


if __name__ == "__main__":
    app()
