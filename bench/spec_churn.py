"""K changed at random under load: does vLLM survive every schedule the controller can send?

Runs in the caller's terminal process, which owns one vLLM ``AsyncLLM`` (the project's
``VLLMEngine``; vLLM spawns its engine core). The engine starts as the service starts it
with ``speculation_control.enabled`` (``engines/vllm/engine.py::start``: the start-up
schedule holding every K, its check, ``drafter_at_k0``), with a step counter
(``StepCostMonitor.num_steps``) so that changes can be timed in engine steps.

Load: ``--concurrency`` workers, each sending one request after the other (closed loop)
with a prompt of random token ids and a random length in ``--prompt-tokens``, a random
``max_tokens`` in ``--max-tokens`` and ``ignore_eos``, so prefills of every length keep
joining a batch of decodes. Meanwhile one task applies a random schedule every
``--steps-per-change`` engine steps (``VLLMEngine.apply_spec_schedule``, the service's
path), ``--changes`` times: a random K per random bucket, a quarter of them one K at every
batch size (K = 0 included), then the load drains. A request that fails, or ends with
fewer tokens than asked, is an error; so is a dead engine.

The report ends with the graphs the steps ran and how often (``graph_replays.py``; the
engine runs with ``cudagraph_metrics``): after a crash, whether the failing step's graph
had run before. ``--pin '{"1": 0}'`` applies one schedule once instead (the smallest
change to try), and ``--static '[[1,16,3],[17,1024,0]]'`` starts a plain vLLM engine with
that schedule and no project code in its processes (``VLLM_PLUGINS=none`` and no worker
extension: no run-time schedule, no ``drafter_at_k0``, no verify-cost timing) for
``--requests`` requests: a failure there is vLLM's alone. The CUDA graphs are vLLM's own
sizes (``speculation_control.full_cuda_graphs: as_is``, which reproduces the crash);
``--full-cuda-graphs align`` runs the service's aligned sizes (``graph_policy.py``).

    python -m bench.spec_churn --model embedded:tiny --concurrency 16 --changes 100 \\
        --max-tokens 8,48
    CUDA_LAUNCH_BLOCKING=1 python -m bench.spec_churn --model embedded:1b --k-max 3 \\
        --concurrency 256 --changes 1000 --drafter-at-k0 skip

tests/integration/rollout_service/test_spec_churn.py runs :func:`churn` on the real engine
(CPU and, ``gpu``-marked, CUDA graphs).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import time
from collections.abc import Callable
from typing import Any

from bench.graph_replays import GraphReplayMonitor
from rollout_service.config import load_config
from rollout_service.embedded import ensure_model
from rollout_service.engines.base import EngineUnavailableError, SamplingOptions
from rollout_service.engines.vllm.engine import VLLMEngine
from rollout_service.engines.vllm.step_costs import StepCostMonitor

BUCKET_EDGES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
"""Bucket upper edges a random schedule draws from (the controller's defaults and more)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ChurnConfig:
    """One churn run (see the module docstring)."""

    concurrency: int
    """Requests in flight."""
    num_changes: int
    """Schedules applied, one every ``steps_per_change`` engine steps (0: none)."""
    steps_per_change: int = 3
    """Engine steps between two changes."""
    prompt_tokens: tuple[int, int] = (8, 400)
    """Inclusive range of a prompt's length in tokens."""
    max_tokens: tuple[int, int] = (16, 256)
    """Inclusive range of a request's ``max_tokens``."""
    num_requests: int | None = None
    """With ``num_changes == 0``: requests to send in all (default: 4 x concurrency)."""
    pin: dict[int, int] | None = None
    """A schedule applied once before the load, instead of random changes."""
    seed: int = 0
    timeout_s: float = 900.0
    """The whole run's deadline."""


@dataclasses.dataclass(kw_only=True, slots=True)
class Change:
    """One applied schedule."""

    at_s: float
    step: int
    batch_size: int
    schedule: dict[int, int]


@dataclasses.dataclass(kw_only=True, slots=True)
class ChurnReport:
    """What a churn run saw."""

    num_changes: int = 0
    num_k0_everywhere: int = 0
    """Changes that pinned K = 0 at every batch size."""
    num_requests: int = 0
    num_finished: int = 0
    """Requests that ended with every token they asked for."""
    num_steps: int = 0
    max_batch_size: int = 0
    elapsed_s: float = 0.0
    errors: list[str] = dataclasses.field(default_factory=list)
    engine_alive: bool = True
    """The engine still answered its health check at the end (False: it died)."""
    last_changes: list[Change] = dataclasses.field(default_factory=list)
    """The last changes before the end (before a failure: the suspects)."""

    def summary(self) -> str:
        return (f"{self.num_changes} changes ({self.num_k0_everywhere} to K = 0 everywhere) "
                f"over {self.num_steps} steps in {self.elapsed_s:.1f} s, max batch "
                f"{self.max_batch_size}; {self.num_finished}/{self.num_requests} requests "
                f"finished; {len(self.errors)} errors")


def random_schedule(rng: random.Random, k_max: int) -> dict[int, int]:
    """A random table: one K everywhere (a quarter of the time), else a random K per
    bucket over a random subset of :data:`BUCKET_EDGES`."""
    if rng.random() < 0.25:
        return {1: rng.randint(0, k_max)}
    edges = sorted(rng.sample(BUCKET_EDGES, rng.randint(1, 5)))
    return {edge: rng.randint(0, k_max) for edge in edges}


def random_prompt(rng: random.Random, lengths: tuple[int, int], vocab_size: int) -> list[int]:
    """Random token ids (no shared prefix to cache), away from the special ids at the ends."""
    return [rng.randrange(10, vocab_size - 10) for _ in range(rng.randint(*lengths))]


async def churn(engine: VLLMEngine, steps: StepCostMonitor, config: ChurnConfig
                ) -> ChurnReport:
    """Run the load and the changes on ``engine`` (its steps counted by ``steps``) and
    report; never raises for the engine's failures (they are the report's errors)."""
    rng = random.Random(config.seed)
    report = ChurnReport()
    started = time.monotonic()
    deadline = started + config.timeout_s
    changing = asyncio.Event()  # set: the load stops sending new requests
    k_max, vocab = engine.info.num_speculative_tokens, engine.info.vocab_size
    total = config.num_requests or 4 * config.concurrency

    async def one_request(index: int) -> None:
        max_tokens = rng.randint(*config.max_tokens)
        sampling = SamplingOptions(max_tokens=max_tokens, temperature=1.0, seed=index,
                                   ignore_eos=True)
        prompt = random_prompt(rng, config.prompt_tokens, vocab)
        report.num_requests += 1
        try:
            result = await engine.generate(prompt, sampling, f"churn-{index}")
        except Exception as exc:  # the report's business, not the caller's
            report.errors.append(f"request {index}: {type(exc).__name__}: {exc}")
            if isinstance(exc, EngineUnavailableError):
                changing.set()
            return
        if len(result.token_ids) != max_tokens:
            report.errors.append(f"request {index}: {len(result.token_ids)} of {max_tokens} "
                                 f"tokens ({result.finish_reason})")
            return
        report.num_finished += 1

    async def worker(first: int) -> None:
        index = first
        while not changing.is_set() and time.monotonic() < deadline:
            if config.num_changes == 0 and index >= total:
                return
            await one_request(index)
            report.max_batch_size = max(report.max_batch_size, engine.batch_size)
            index += config.concurrency

    async def change(schedule: dict[int, int]) -> None:
        report.last_changes = [*report.last_changes[-19:], Change(
            at_s=time.monotonic() - started, step=steps.num_steps,
            batch_size=engine.batch_size, schedule=schedule)]
        await engine.apply_spec_schedule(schedule)
        report.num_changes += 1
        report.num_k0_everywhere += set(schedule.values()) == {0}

    async def changer() -> None:
        try:
            if config.pin is not None:
                await change(config.pin)
            for _ in range(config.num_changes):
                target = steps.num_steps + config.steps_per_change
                while steps.num_steps < target and not changing.is_set():
                    if time.monotonic() > deadline:
                        report.errors.append(f"deadline: {report.num_changes} changes")
                        return
                    await asyncio.sleep(0.001)  # poll interval of a deadline loop
                if changing.is_set():
                    return
                await change(random_schedule(rng, k_max))
        except Exception as exc:
            report.errors.append(f"change {report.num_changes}: {type(exc).__name__}: {exc}")
        finally:
            if config.num_changes:
                changing.set()

    change_task = asyncio.create_task(changer())
    await asyncio.gather(*(worker(i) for i in range(config.concurrency)))
    changing.set()
    await change_task
    report.num_steps, report.elapsed_s = steps.num_steps, time.monotonic() - started
    try:
        await engine.health()
    except EngineUnavailableError as exc:
        report.engine_alive = False
        report.errors.append(f"engine: {exc}")
    return report


def start_engine(model: str, *, k_max: int, drafter_at_k0: str, engine_kwargs: dict[str, Any],
                 full_cuda_graphs: str = "as_is",
                 static: list[list[int]] | None = None
                 ) -> tuple[VLLMEngine, GraphReplayMonitor]:
    """The engine as the service starts it with the speculation control on (the steps of
    ``engines/vllm/engine.py::start`` but with a monitor of its own), or with ``static``:
    vLLM alone with that schedule."""
    from rollout_service.engines.vllm import drafter_at_k0 as skip_module
    from rollout_service.engines.vllm.engine_args import build_engine_args
    from rollout_service.engines.vllm.graph_policy import with_user_schedule_graphs
    from rollout_service.engines.vllm.spec_schedule import with_startup_schedule
    from rollout_service.local import engine_spec

    # FULL CUDA graphs as vLLM sizes them by default: reproducing what they do under
    # changes is this bench's job (--full-cuda-graphs align: the service's fix).
    control = {"enabled": static is None, "drafter_at_k0": drafter_at_k0,
               "full_cuda_graphs": full_cuda_graphs}
    spec = engine_spec(load_config(model=model, engine_kwargs=engine_kwargs,
                                   mtp={"num_speculative_tokens": k_max},
                                   speculation_control=control))
    args = build_engine_args(spec.model_path, spec.engine_kwargs, spec.mtp,
                             spec.checkpoint_config, served_model_name=spec.served_model_name)
    if static is None:
        skip_module.resolve(spec.drafter_at_k0, args)  # run or skip, as asked
        args = with_startup_schedule(args, full_cuda_graphs=spec.full_cuda_graphs)
    else:
        os.environ["VLLM_PLUGINS"] = "none"  # nothing of this project in vLLM's processes
        speculative = {**args.speculative_config,
                       "num_speculative_tokens_per_batch_size": static}
        args = dataclasses.replace(args, speculative_config=speculative,
                                   weight_transfer_config=None, worker_extension_cls="")
        # The batch sizes at which vLLM alone will replay a diverging drafter graph, logged.
        args = with_user_schedule_graphs(args, "as_is")
    monitor = GraphReplayMonitor()
    return VLLMEngine.start(args, served_model_name=spec.served_model_name,
                            step_costs=monitor), monitor


async def prepare(engine: VLLMEngine, *, static: bool, skip: bool) -> None:
    """What ``start`` does once the engine runs: check its schedule, skip the drafter,
    time a verify step with the model runner's dummy batches (``static``: vLLM alone,
    none of it)."""
    if static:
        return
    await engine.check_spec_schedule()
    if skip:
        await engine.skip_drafter_at_k0()
    await engine.measure_verify_cost(8)  # the service's default verify_cost_batch_size


def _ints(text: str) -> tuple[int, int]:
    low, high = (int(x) for x in text.split(","))
    return low, high


async def run(opts: argparse.Namespace, print_line: Callable[[str], None]) -> ChurnReport:
    static = json.loads(opts.static) if opts.static else None
    # Each step's graph (mode, padded tokens) in its stats, for GraphReplayMonitor; on the
    # CPU the embedded defaults besides.
    model, engine_kwargs = opts.model, {"cudagraph_metrics": True}
    if opts.device == "cuda":  # the checkpoint's own context, vLLM's defaults, graphs
        if model.startswith("embedded:"):
            model = str(ensure_model(model.removeprefix("embedded:")))
        engine_kwargs |= {"gpu_memory_utilization": opts.gpu_memory_utilization,
                          "dtype": opts.dtype, "enforce_eager": opts.eager}
        if opts.cudagraph_mode:  # e.g. PIECEWISE: which graphs the failure needs
            engine_kwargs["compilation_config"] = {"cudagraph_mode": opts.cudagraph_mode}
    engine, monitor = start_engine(model, k_max=opts.k_max, static=static,
                                   drafter_at_k0=opts.drafter_at_k0,
                                   full_cuda_graphs=opts.full_cuda_graphs,
                                   engine_kwargs=engine_kwargs)
    try:
        await prepare(engine, static=static is not None, skip=opts.drafter_at_k0 == "skip")
        pin = ({int(b): k for b, k in json.loads(opts.pin).items()} if opts.pin else None)
        config = ChurnConfig(
            concurrency=opts.concurrency, steps_per_change=opts.steps_per_change,
            num_changes=0 if static or pin else opts.changes, pin=pin,
            prompt_tokens=_ints(opts.prompt_tokens), max_tokens=_ints(opts.max_tokens),
            num_requests=opts.requests, seed=opts.seed)
        print_line(f"churn: {config}")
        report = await churn(engine, monitor, config)
    finally:
        await engine.shutdown()
    for c in report.last_changes[-8:]:
        print_line(f"  change at {c.at_s:.2f} s, step {c.step}, batch {c.batch_size}: "
                   f"{c.schedule}")
    for error in report.errors[:10]:
        print_line(f"  error: {error[:400]}")
    for line in monitor.report():
        print_line(line)
    print_line(f"churn: {report.summary()}")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded:tiny")
    parser.add_argument("--k-max", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--changes", type=int, default=1000)
    parser.add_argument("--steps-per-change", type=int, default=3)
    parser.add_argument("--prompt-tokens", default="8,400", help="LOW,HIGH")
    parser.add_argument("--max-tokens", default="16,256", help="LOW,HIGH")
    parser.add_argument("--requests", type=int, default=None,
                        help="with --pin or --static: requests in all (default 4 x concurrency)")
    parser.add_argument("--drafter-at-k0", choices=("run", "skip"), default="run")
    parser.add_argument("--pin", default=None, help='one schedule, e.g. \'{"1": 0}\'')
    parser.add_argument("--static", default=None,
                        help="vLLM alone with these ranges, e.g. '[[1,16,3],[17,1024,0]]'")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16", help="on the GPU")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--eager", action="store_true", help="no compile, no CUDA graphs")
    parser.add_argument("--full-cuda-graphs", choices=("as_is", "align"), default="as_is",
                        help="speculation_control.full_cuda_graphs (as_is: vLLM's sizes)")
    parser.add_argument("--cudagraph-mode", default=None,
                        help="vLLM's compilation_config.cudagraph_mode (FULL_AND_PIECEWISE, "
                             "PIECEWISE, FULL_DECODE_ONLY, ...)")
    opts = parser.parse_args()
    if opts.device is None:
        from vllm.platforms import current_platform

        opts.device = "cuda" if current_platform.is_cuda() else "cpu"
    report = asyncio.run(run(opts, print))
    raise SystemExit(1 if report.errors else 0)


if __name__ == "__main__":
    main()
