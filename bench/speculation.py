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
static K of a rollout is taken over K >= 1); ``controller``, the ``spec`` service unpinned
(each run followed by the schedules its engine took meanwhile); with ``--frozen``,
``frozen``, the controller's own schedule pinned before each round (``controller /
frozen``: what its deciding during a round costs, apart from the K it chose).

Two workloads, each measured round by round with the modes' order rotated and reversed
every other round (``round_order``: drift of the machine hits every mode alike, and no
mode always follows the same one; a pin is applied before its mode's round, untimed, and is
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

from bench.engine_options import resolve_device
from bench.serving import HttpMode, Workload, start_http
from bench.speculation_options import parse_options
from bench.speculation_report import mode_name, model_check, print_report
from bench.speculation_rounds import (
    FROZEN,
    Mode,
    Pin,
    Rollout,
    Round,
    interleaved,
    level_round,
    profiled,
    prompts_needed,
    rollout_lengths,
    rollout_round,
    watched,
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
    schedules: dict[str, Pin] = {
        f"k={k}": dict.fromkeys(services.buckets, k) for k in opts.static_k}
    schedules["controller"] = None
    if opts.frozen:
        schedules["frozen"] = FROZEN
    async with contextlib.AsyncExitStack() as stack:
        clients = {d: await stack.enter_async_context(
            RolloutClient(s.url, weights_token=WEIGHTS_TOKEN)) for d, s in specs.items()}

        def modes(on_off: Round, on_spec: Callable[[HttpMode, str], Round],
                  level: str) -> dict[str, Mode]:
            chosen = {"spec-off": Mode(run=on_off)}
            for d, spec in specs.items():
                for name, schedule in schedules.items():
                    mode = mode_name(name, d, opts.drafter_at_k0)
                    chosen[mode] = (  # the controller: did its schedule move mid-run?
                        watched(clients[d], on_spec(spec, mode), printer(
                            f"{label} {level}, {mode}")) if schedule is None
                        else with_pin(clients[d], schedule, on_spec(spec, mode)))
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
                control = await client.pin_schedule(None)  # answers with the state
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

        def printer(what: str) -> Callable[[object], None]:
            return lambda line: console.print(f"  {what}: {line}")

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
                                    printer(f"{label} rollout, spec-off"),
                                    waves=opts.waves),
                      lambda spec, mode: rollout_round(
                          spec, rollout, opts.temperature,
                          printer(f"{label} rollout, {mode}"), waves=opts.waves),
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


def main() -> None:
    opts, noises = parse_options()
    resolve_device(opts)
    # The services read it from the environment (a config file would carry it masked).
    os.environ[WEIGHTS_TOKEN_ENV] = WEIGHTS_TOKEN
    asyncio.run(run(opts, noises, Console()))


if __name__ == "__main__":
    main()
