"""``rollout-service`` command line.

``serve`` runs the service standalone under uvicorn in this process (the engine
spawns its own worker process); ``serve-ray`` deploys it on Ray Serve with N
engine replicas (``serve/``). The rest are tools (``tools/``): ``demo`` and
``rl-demo`` start ``serve`` as a child process and talk to it over HTTP, as a
trainer would; ``look`` renders Prometheus's view of it; ``make-model`` builds
the embedded checkpoint.
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

if TYPE_CHECKING:
    import uvicorn

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging() -> None:
    """INFO logs of the service, without httpx's line per HTTP call: the SGLang engine makes
    one per generation request, which doubled the service's log (the access log already
    has a line per request) and put a formatted write on the event loop for each. Failed
    calls still show, as the caller's errors."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    logging.getLogger("httpx").setLevel(logging.WARNING)

def server_config(app_: Any, keep_alive_s: float, *, access_log: bool = True
                  ) -> uvicorn.Config:
    """uvicorn's config of the standalone service: httptools and uvloop by name (both
    dependencies). uvicorn's ``auto`` falls back to the pure-Python h11 parser and
    asyncio's loop without a word where they are missing, as a service on the GPU
    machine did (its profile, docs/sglang.md), and every request pays for it."""
    import uvicorn

    return uvicorn.Config(app_, log_level="info", http="httptools", loop="uvloop",
                          timeout_keep_alive=keep_alive_s, access_log=access_log)


app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="RL rollout service with MTP speculative decoding.")


@app.command()
def serve(
    config: Annotated[Optional[Path], typer.Option(help="Service config (YAML or JSON).")] = None,
    host: Annotated[Optional[str], typer.Option(
        help="Bind address (overrides the config).")] = None,
    port: Annotated[Optional[int], typer.Option(help="Port (overrides the config).")] = None,
    model: Annotated[Optional[str], typer.Option(
        help="Checkpoint dir or embedded:tiny / embedded:small (overrides the config).")] = None,
) -> None:
    """Serve the HTTP API on one engine (the embedded tiny MTP model by default)."""
    import uvicorn

    from rollout_service.api.app import create_app
    from rollout_service.config import load_config

    configure_logging()
    try:
        cfg = load_config(config, host=host, port=port, model=model)
        app_ = create_app(cfg)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    # The port is taken now, before the engine starts (a minute or more), not when
    # uvicorn listens after it: a port already in use fails at once, and no other
    # process can take it meanwhile. Bound, not listening: until the service is up,
    # connections are refused instead of waiting in a backlog.
    try:
        sock = reserve_port(cfg.host, cfg.port)
    except OSError as exc:
        raise typer.BadParameter(f"{cfg.host}:{cfg.port}: {exc.strerror}",
                                 param_hint="--port") from exc
    server = uvicorn.Server(server_config(app_, cfg.http_keep_alive_s,
                                          access_log=cfg.http_access_log))
    server.run(sockets=[sock])


def reserve_port(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port``, not yet listening (uvicorn listens on it).

    Raises:
        OSError: the address is in use or cannot be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


@app.command("serve-ray")
def serve_ray(
    config: Annotated[Optional[Path], typer.Option(
        help="Ray Serve config (YAML or JSON): the serve fields plus replicas, resources.")] = None,
    host: Annotated[Optional[str], typer.Option(
        help="Bind address (overrides the config).")] = None,
    port: Annotated[Optional[int], typer.Option(help="Port (overrides the config).")] = None,
    model: Annotated[Optional[str], typer.Option(help="Checkpoint (overrides the config).")] = None,
    replicas: Annotated[Optional[int], typer.Option(
        help="Engine replicas (overrides num_replicas).")] = None,
    address: Annotated[Optional[str], typer.Option(
        help="Ray cluster address (e.g. 'auto'); default: start a local Ray.")] = None,
    num_cpus: Annotated[Optional[int], typer.Option(
        help="CPUs of the local Ray (default: all of this machine's).")] = None,
) -> None:
    """Serve the HTTP API on Ray Serve: N engine replicas, pushes reach every one."""
    from rollout_service.serve.config import load_serve_config

    configure_logging()
    try:
        cfg = load_serve_config(config, host=host, port=port, model=model, num_replicas=replicas)
        cfg.resolved_weights_token()
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    from rollout_service.serve.app import run

    run(cfg, address=address, num_cpus=num_cpus)


@app.command()
def demo(
    num_prompts: Annotated[int, typer.Option(help="Prompts in the batch.")] = 32,
    max_tokens: Annotated[int, typer.Option(help="Tokens per answer.")] = 48,
    temperature: Annotated[float, typer.Option(help="Sampling temperature.")] = 1.0,
    model: Annotated[str, typer.Option(help="Model to serve.")] = "embedded:tiny",
) -> None:
    """Start the service, roll out a batch, show per-request and macro acceptance."""
    from rollout_service.tools.demo import run_demo

    run_demo(num_prompts=num_prompts, max_tokens=max_tokens, temperature=temperature,
             model=model)


@app.command("rl-demo")
def rl_demo(
    steps: Annotated[int, typer.Option(help="Training steps per run.")] = 20,
    batch_size: Annotated[int, typer.Option(help="Prompts per step.")] = 16,
    max_tokens: Annotated[int, typer.Option(help="Tokens per sample.")] = 32,
    lr: Annotated[float, typer.Option(help="Adam learning rate.")] = 2e-3,
    mtp_scaling_factor: Annotated[float, typer.Option(help="MTP loss weight.")] = 1.0,
    num_speculative_tokens: Annotated[int, typer.Option(help="Draft tokens per step.")] = 2,
    seed: Annotated[int, typer.Option(help="Torch and prompt seed.")] = 0,
    plot: Annotated[Path, typer.Option(help="Where the PNG goes.")] = Path("mtp-demo.png"),
) -> None:
    """The RL loop twice from the same weights: drafter synced every step vs never."""
    from rollout_service.tools.rl_demo import DemoOptions, run_rl_demo

    run_rl_demo(DemoOptions(num_steps=steps, batch_size=batch_size, max_tokens=max_tokens,
                            lr=lr, mtp_scaling_factor=mtp_scaling_factor,
                            num_speculative_tokens=num_speculative_tokens, seed=seed), plot)


@app.command()
def look(
    prometheus: Annotated[str, typer.Option(help="Prometheus base URL.")] = "http://127.0.0.1:9090",
    out: Annotated[Path, typer.Option(help="PNG to write.")] = Path("rollout-look.png"),
    minutes: Annotated[float, typer.Option(help="How far back.")] = 15.0,
    step: Annotated[float, typer.Option(help="Seconds between points.")] = 15.0,
    window: Annotated[str, typer.Option(help="rate() window.")] = "1m",
) -> None:
    """Render the key panels (macro vs micro acceptance, weight versions) into a PNG."""
    from rollout_service.tools.look import render_look

    try:
        render_look(prometheus, out, minutes=minutes, step_s=step, window=window)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    typer.echo(out)


@app.command("make-model")
def make_model(
    size: Annotated[str, typer.Option(help="tiny, small, 1b or 7b.")] = "tiny",
    out: Annotated[Optional[Path], typer.Option(help="Directory (default: the cache).")] = None,
) -> None:
    """Generate the embedded MiMo checkpoint with one MTP layer and print its path."""
    from rollout_service.embedded import ensure_model

    typer.echo(ensure_model(size, cache_dir=out))


if __name__ == "__main__":
    app()
