"""The speculation control against static K and no speculation: does it ever slow rollout?

Runs in the caller's terminal process. One set of services for the whole run, at once,
as child processes (``rollout-service serve``), started on the first ``--draft-noise``'s
checkpoint (the embedded generator's knob for the drafter's accuracy); each later
noise's drafter arrives as a drafter push, as from a trainer (the controller starts a new
acceptance epoch and probes it; the main model is the same for every noise):

- ``off``: the same checkpoint with ``mtp.enabled: false``, an engine without a drafter;
- ``spec``: ``--k-max`` draft tokens with the speculation control on, calibrated at
  start; one per ``--drafter-at-k0`` value (``run,skip``: modes named ``k=0 run`` ...).

The modes: ``spec-off`` (the ``off`` service); ``k=0`` .. ``k=<k-max>``, the ``spec``
service pinned to one K at every batch size (``POST /speculation/schedule``), so a static
K costs no engine of its own (``k=0`` against ``spec-off`` is the floor the controller can
reach: with ``drafter_at_k0: run`` vLLM still runs the MTP drafter at K = 0; the best
static K of a rollout is taken over K >= 1); ``controller``, the ``spec`` service unpinned.

Two workloads, each measured round by round with the modes' order rotated (drift of the
machine hits every mode alike; a pin is applied before its mode's round, untimed, and is
in force when the pin call returns; a round starts once the servers are back at rest,
``bench/quiet.py``):

- fixed concurrency (``--concurrency``): c requests in flight (closed loop, c x
  ``--waves`` requests a round), each exactly ``--max-tokens`` tokens (``ignore_eos``);
  tokens/s;
- a decaying rollout (``--rollout-prompts``, 0 skips it): every prompt sent at once, each
  with its own length from a long-tailed (Pareto) distribution capped at
  ``--rollout-max-tokens``, so concurrency decays from all prompts to one; the wall time
  to finish all, as tokens/s (``--waves`` rollouts back to back a round).

A stale drafter (``--stale-drafter``): one more run with the first ``--draft-noise``'s
drafter (pushed back) after a ``main`` push of another seed's model to every service
(the drafter stays), as when a trainer stops syncing it: the controller must keep
spec-off's speed. ``--stale-only``: that run alone.

Ratios printed: the controller over spec-off (target >= 0.98 at every concurrency), and on
the decaying rollout the controller over the best static K of that run (target >= 1.10).

    python -m bench.speculation --model embedded:tiny --draft-noise 0.25 --k-max 2 \\
        --concurrency 1,8 --max-tokens 32 --rounds 2 --rollout-prompts 32
    python -m bench.speculation --model embedded:1b --draft-noise 0.1,0.3,0.6 --k-max 3 \\
        --concurrency 1,16,64,256 --max-tokens 256 --rollout-prompts 512 --stale-drafter
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from safetensors.torch import load_file

from bench.engine_options import add_device_arguments, resolve_device
from bench.serving import HttpMode, Workload, start_http
from bench.speculation_report import mode_name, model_check, print_report
from bench.speculation_rounds import (
    Mode,
    Rollout,
    RolloutTail,
    Round,
    interleaved,
    level_round,
    levels_arg,
    profiled,
    prompts_needed,
    rollout_lengths,
    rollout_round,
    with_pin,
)
from rollout_service.client import RolloutClient
from rollout_service.config import (
    EMBEDDED_ENGINE_KWARGS,
    WEIGHTS_TOKEN_ENV,
    ServiceConfig,
    load_config,
)
from rollout_service.embedded.corpus import arithmetic_prompts
from rollout_service.embedded.tiny_mimo import WeightInit, ensure_model
from trainer_client.push import WeightPusher

WEIGHTS_TOKEN = "bench-speculation"
MOVED_POLICY_SEED = 1
"""Seed of the main model that makes a drafter stale (the checkpoints' own seed is 0)."""


GPU_MEMORY_SHARED = 0.85
"""The GPU memory fraction the bench's engines share by default (vLLM's own default for
one engine is 0.9; the rest is the CUDA contexts' and the graphs')."""
GPU_MEMORY_PER_ENGINE = 0.4
"""At most this fraction per engine by default: the 1B model and its KV cache need less."""


def per_engine_memory(requested: float | None, *, num_engines: int) -> float:
    """``--gpu-memory-utilization`` for each of ``num_engines`` engines on one GPU: the
    request, or the default share (:data:`GPU_MEMORY_SHARED` split, at most
    :data:`GPU_MEMORY_PER_ENGINE`). vLLM takes the fraction of the whole GPU per engine and
    refuses an engine that finds less free, so three at 0.4 failed at start-up.

    Raises:
        ValueError: the request over all engines passes the whole GPU.
    """
    if requested is None:
        return round(min(GPU_MEMORY_PER_ENGINE, GPU_MEMORY_SHARED / num_engines), 2)
    if not 0 < requested * num_engines <= 1:
        raise ValueError(f"--gpu-memory-utilization: {requested} for each of {num_engines} "
                         f"engines is {requested * num_engines:.2f} of the GPU; give at most "
                         f"{1 / num_engines:.2f}")
    return requested


def service_config(opts: argparse.Namespace, model: Path, *,
                   drafter_at_k0: str | None) -> ServiceConfig:
    """The ``off`` service's config (``drafter_at_k0`` None) or a ``spec`` one."""
    speculation = drafter_at_k0 is not None
    overrides: dict[str, Any] = {
        "mtp": ({"num_speculative_tokens": opts.k_max} if speculation
                else {"enabled": False}),
    }
    if speculation:
        overrides["speculation_control"] = {  # as_is: the graphs vLLM serves with by default
            "enabled": True, "drafter_at_k0": drafter_at_k0,
            "full_cuda_graphs": opts.full_cuda_graphs,
            "calibration": {"max_batch_size": opts.calibration_max_batch_size}}
    if opts.device == "cuda":
        overrides["engine_kwargs"] = {"dtype": "bfloat16", "enforce_eager": opts.eager,
                                      "gpu_memory_utilization": opts.gpu_memory_utilization}
        if opts.max_capture_tokens is not None:  # every engine, spec-off's too
            overrides["engine_kwargs"]["compilation_config"] = {
                "max_cudagraph_capture_size": opts.max_capture_tokens}
    else:  # what "embedded:<size>" would get; the checkpoint here is a generated directory
        overrides["engine_kwargs"] = dict(EMBEDDED_ENGINE_KWARGS)
    return load_config(model=str(model), **overrides)


def push_checkpoint(urls: list[str], checkpoint: Path, *, version: int, target: str) -> None:
    """Push ``checkpoint``'s tensors to every service at ``urls`` as ``target``."""
    tensors = load_file(str(checkpoint / "model.safetensors"))
    for url in urls:
        with WeightPusher(url, WEIGHTS_TOKEN) as pusher:
            pusher.push(tensors.items(), version=version, target=target)


@dataclasses.dataclass(kw_only=True, slots=True)
class Services:
    """The services of one run: ``off`` and a ``spec`` one per ``drafter_at_k0`` value."""

    off: HttpMode
    specs: dict[str, HttpMode]
    buckets: list[int]
    """The controller's batch-size buckets (a static K is pinned at each)."""
    logs: Path
    """Where the services' logs and the controllers' states go."""

    def all(self) -> list[HttpMode]:
        return [self.off, *self.specs.values()]

    def urls(self, *, specs_only: bool = False) -> list[str]:
        return [s.url for s in (self.specs.values() if specs_only else self.all())]


async def start_services(opts: argparse.Namespace, model: Path, workload: Workload,
                         scratch: Path, max_level: int, console: Console) -> Services:
    """Start ``off`` and the ``spec`` services on ``model`` (each healthy on return)."""
    started: dict[str, HttpMode] = {}
    try:
        for name, drafter_at_k0 in (("off", None),
                                    *((f"spec-{d}", d) for d in opts.drafter_at_k0)):
            console.print(f"starting the {name} service ...")
            (scratch / name).mkdir(parents=True, exist_ok=True)
            began = time.perf_counter()
            started[name] = await start_http(
                "service", service_config(opts, model, drafter_at_k0=drafter_at_k0),
                workload, scratch / name, max_level)
            console.print(f"  the {name} service is healthy after "
                          f"{time.perf_counter() - began:.0f} s")
    except BaseException:
        for server in started.values():
            await server.close()
        raise
    buckets = service_config(opts, model, drafter_at_k0="run"
                             ).speculation_control.batch_size_buckets
    return Services(off=started["off"], buckets=list(buckets), logs=scratch,
                    specs={d: started[f"spec-{d}"] for d in opts.drafter_at_k0})


async def measure(opts: argparse.Namespace, services: Services, label: str,
                  prompts: tuple[str, ...], console: Console
                  ) -> dict[str, dict[str, list[float]]]:
    """Every workload on the services' current weights: ``{workload: {mode: tok/s per
    round}}``."""
    off, specs = services.off, services.specs
    schedules: dict[str, dict[int, int] | None] = {
        f"k={k}": dict.fromkeys(services.buckets, k) for k in opts.static_k}
    schedules["controller"] = None
    async with contextlib.AsyncExitStack() as stack:
        clients = {d: await stack.enter_async_context(
            RolloutClient(s.url, weights_token=WEIGHTS_TOKEN)) for d, s in specs.items()}

        def modes(on_off: Round, on_spec: Callable[[HttpMode, str], Round],
                  level: str) -> dict[str, Mode]:
            chosen = {"spec-off": Mode(run=on_off)}
            for d, spec in specs.items():
                for name, schedule in schedules.items():
                    mode = mode_name(name, d, opts.drafter_at_k0)
                    chosen[mode] = with_pin(clients[d], schedule, on_spec(spec, mode))
            for name in opts.profile_modes:  # checked against the modes in main()
                pid = (off if name == "spec-off" else specs[opts.drafter_at_k0[0]]).server.pid
                chosen[name] = profiled(chosen[name], pid, Path(opts.profile_dir),
                                        f"{label}-{level}-{name}".replace(" ", "-"))
            return chosen

        async def show_controller(after: str, concurrency: int | None = None) -> None:
            """What each controller has chosen so far, and why (printed after every
            workload, so a later failure does not lose it); its whole state (the expected
            tokens/s per K and bucket, the cost table, the acceptance) into ``logs``;
            after a fixed ``concurrency``, its model against the pinned modes."""
            for d, client in clients.items():
                await client.pin_schedule(None)
                control = (await client.health()).speculation_control
                if control is not None:
                    console.print(f"  {label} after {after}: controller ({d}) K "
                                  + ", ".join(f"B<={b.batch_size}: {b.k} ({b.reason})"
                                              for b in control.buckets)
                                  + f"; first-position acceptance {control.acceptance[:1]}")
                    name = f"controller-{label}-{d}-after-{after}".replace(" ", "-")
                    (services.logs / f"{name}.json").write_text(control.model_dump_json())
                    if concurrency is not None:
                        suffix = mode_name("", d, opts.drafter_at_k0)
                        console.print(model_check(f"{label} c={concurrency} ({d})",
                                                  concurrency, control,
                                                  results[f"c={concurrency}"], suffix))

        def tail_printer(what: str) -> Callable[[RolloutTail], None]:
            return lambda tail: console.print(f"  {what}: {tail}")

        results: dict[str, dict[str, list[float]]] = {}
        for c in opts.concurrency:
            results[f"c={c}"] = await interleaved(
                modes(level_round(off, c, opts.waves),
                      lambda spec, _, c=c: level_round(spec, c, opts.waves), f"c{c}"),
                opts.rounds, f"{label} c={c}", console)
            await show_controller(f"c={c}", c)
        if opts.rollout_prompts:
            rollout = Rollout(prompts=prompts[:opts.rollout_prompts],
                              lengths=rollout_lengths(opts.rollout_prompts,
                                                      opts.rollout_max_tokens))
            results[f"rollout {opts.rollout_prompts}"] = await interleaved(
                modes(rollout_round(off, rollout, opts.temperature,
                                    tail_printer(f"{label} rollout, spec-off"),
                                    waves=opts.waves),
                      lambda spec, mode: rollout_round(
                          spec, rollout, opts.temperature,
                          tail_printer(f"{label} rollout, {mode}"), waves=opts.waves),
                      "rollout"),
                opts.rounds, f"{label} rollout", console)
            await show_controller("the rollout")
    return results


async def run(opts: argparse.Namespace, noises: list[float], console: Console) -> None:
    """One set of services for the whole run: started on the first noise's checkpoint;
    each later drafter arrives as a drafter push (as from a trainer: the controller starts
    a new acceptance epoch and probes it), the main model unchanged (the embedded
    generator draws it from the seed alone). The stale case: the first drafter pushed
    back, then another seed's main model (:data:`MOVED_POLICY_SEED`) to every service."""
    size = opts.model.removeprefix("embedded:")
    checkpoints = [ensure_model(size, init=WeightInit(draft_noise=n)) for n in noises]
    max_level = max([*opts.concurrency, opts.rollout_prompts])
    prompts = tuple(p for p, _ in arithmetic_prompts(
        prompts_needed(opts.concurrency, opts.waves, opts.rollout_prompts)))
    workload = Workload(prompts=prompts, max_tokens=opts.max_tokens,
                        temperature=opts.temperature)
    scratch = Path(opts.logs or tempfile.mkdtemp(prefix="bench-speculation-"))
    services = await start_services(opts, checkpoints[0], workload, scratch, max_level,
                                    console)
    try:
        fresh = [] if opts.stale_only else list(zip(noises, checkpoints, strict=True))
        for version, (noise, checkpoint) in enumerate(fresh):
            if version:
                console.print(f"pushing the drafter of noise {noise:g} (version {version})")
                await asyncio.to_thread(push_checkpoint, services.urls(specs_only=True),
                                        checkpoint, version=version, target="draft")
            print_report(console, f"draft_noise {noise:g}",
                         await measure(opts, services, f"noise {noise:g}", prompts, console))
        if opts.stale_drafter or opts.stale_only:  # the first drafter again, a new epoch
            await asyncio.to_thread(push_checkpoint, services.urls(specs_only=True),
                                    checkpoints[0], version=len(noises), target="draft")
            console.print(f"moving the policy away from the drafter of noise {noises[0]:g}")
            moved = ensure_model(size, init=WeightInit(seed=MOVED_POLICY_SEED,
                                                       draft_noise=noises[0]))
            await asyncio.to_thread(push_checkpoint, services.urls(), moved, version=1,
                                    target="main")
            print_report(console, f"draft_noise {noises[0]:g}, stale (main pushed from seed "
                         f"{MOVED_POLICY_SEED})", await measure(
                             opts, services, f"noise {noises[0]:g} stale", prompts, console))
    finally:
        for server in services.all():
            await server.close()


def parse_options(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[float]]:
    """The command line, checked (``parser.error`` names the flag): the options, with
    ``static_k``, ``drafter_at_k0`` and ``profile_modes`` as lists, and the drafter
    noises."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded:small",
                        help="embedded:<size> (tiny, small, 1b, 7b)")
    parser.add_argument("--draft-noise", default="0.25",
                        help="comma-separated drafter noises, one checkpoint (and run) each")
    parser.add_argument("--k-max", type=int, default=3, help="the spec engine's largest K")
    parser.add_argument("--static-k", default=None, help="comma-separated K values to pin "
                        "as static modes (default: 0 .. k-max)")
    parser.add_argument("--full-cuda-graphs", choices=("align", "as_is"), default="align",
                        help="speculation_control.full_cuda_graphs of the spec engines")
    parser.add_argument("--drafter-at-k0", default="auto",
                        help="comma-separated speculation_control.drafter_at_k0 values, one "
                             "spec engine each (run,skip: the A/B on one run; skip: "
                             "model runner V2 on CUDA only; auto: skip where it can)")
    parser.add_argument("--profile-modes", default="",
                        help="comma-separated modes (spec-off, k=<K>, controller) to sample "
                             "with py-spy, service and engine core, every round")
    parser.add_argument("--profile-dir", default="bench-speculation-profiles", help="where "
                        "--profile-modes writes (read with bench.profile_summary)")
    parser.add_argument("--stale-drafter", action="store_true", help="one more run: the first "
                        "noise's drafter after a main push of another seed's model")
    parser.add_argument("--stale-only", action="store_true", help="the stale run alone "
                        "(the first noise's services, no fresh run before it)")
    parser.add_argument("--concurrency", type=levels_arg, default="1,4,16,64",
                        help="comma-separated levels (empty: the rollout only)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--waves", type=int, default=1,
                        help="a fixed-concurrency round sends c x WAVES requests, c in flight "
                        "(closed loop), a rollout round runs WAVES rollouts back to back: "
                        "longer rounds, less spread (16 x 256 tokens: < 1 s on a GPU)")
    parser.add_argument("--rollout-prompts", type=int, default=512,
                        help="prompts of the decaying rollout (0: no rollout)")
    parser.add_argument("--rollout-max-tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per mode")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-capture-tokens", type=int, default=None,
                        help="CUDA: vLLM's max_cudagraph_capture_size for every engine "
                             "(default: vLLM's 512 tokens for spec-off, the service's "
                             "(k_max + 1) x 512 for the controlled engines)")
    parser.add_argument("--calibration-max-batch-size", type=int, default=32,
                        help="the controller's start-up calibration grid goes up to this")
    add_device_arguments(parser, gpu_memory_utilization=None, engines=(
        "spec-off's and one per --drafter-at-k0 value at once; default: "
        f"{GPU_MEMORY_SHARED} shared among them, at most {GPU_MEMORY_PER_ENGINE} each"))
    opts = parser.parse_args(argv)
    if not opts.model.startswith("embedded:"):
        parser.error("--model: embedded:<size> only (each drafter noise is generated)")
    if opts.rounds < 1 or opts.k_max < 1 or opts.waves < 1:
        parser.error("--rounds, --k-max and --waves must be >= 1")
    try:
        noises = [float(x) for x in opts.draft_noise.split(",")]
    except ValueError:
        parser.error(f"--draft-noise: comma-separated numbers, got {opts.draft_noise!r}")
    try:
        opts.static_k = (list(range(opts.k_max + 1)) if opts.static_k is None
                         else [int(k) for k in opts.static_k.split(",")])
    except ValueError:
        parser.error(f"--static-k: comma-separated integers, got {opts.static_k!r}")
    if any(not 0 <= k <= opts.k_max for k in opts.static_k):
        parser.error(f"--static-k: each K in 0 .. --k-max ({opts.k_max})")
    opts.drafter_at_k0 = opts.drafter_at_k0.split(",")
    if not opts.drafter_at_k0 or set(opts.drafter_at_k0) - {"run", "skip", "auto"} or len(
            set(opts.drafter_at_k0)) != len(opts.drafter_at_k0):
        parser.error("--drafter-at-k0: distinct values among run, skip, auto")
    opts.profile_modes = [m for m in opts.profile_modes.split(",") if m]
    known = {"spec-off", *(mode_name(m, d, opts.drafter_at_k0) for d in opts.drafter_at_k0
                           for m in ("controller", *(f"k={k}" for k in opts.static_k)))}
    if unknown := set(opts.profile_modes) - known:
        parser.error(f"--profile-modes: {sorted(unknown)} not among the modes {sorted(known)}")
    try:
        opts.gpu_memory_utilization = per_engine_memory(
            opts.gpu_memory_utilization, num_engines=1 + len(opts.drafter_at_k0))
    except ValueError as exc:
        parser.error(str(exc))
    return opts, noises


def main() -> None:
    opts, noises = parse_options()
    resolve_device(opts)
    # The services read it from the environment (a config file would carry it masked).
    os.environ[WEIGHTS_TOKEN_ENV] = WEIGHTS_TOKEN
    asyncio.run(run(opts, noises, Console()))


if __name__ == "__main__":
    main()
