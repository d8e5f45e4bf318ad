"""The runner of ``bench/chaos.py``: one rollout service, one Prometheus and the RL loop's
trainer, and the cases run one after another against them.

Runs in the caller's process, which plays the trainer (``trainer_client.loop``'s steps on
CPU, pushing through ``WeightPusher``). It starts the service as a child process
(``rollout-service serve`` through ``tests/support/fake_stats_outage.py``, talked to over
HTTP and the push transport) and Prometheus as another (scraping the service, queried
over its HTTP API for alerts and figures). Apart from the cases (``bench/chaos_cases.py``)
and the command line (``bench/chaos.py``) because it is the only part that starts and
stops processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch

from bench.chaos_cases import CASES, Case, CaseResult, Fault
from deploy.prometheus import rules
from rollout_service.embedded.corpus import arithmetic_prompts
from rollout_service.embedded.tiny_mimo import WeightInit, ensure_model
from rollout_service.protocol import messages
from rollout_service.tools.launch import ChildProcess, ServiceProcess, free_port, wait_until
from tests.support.fake_stats_outage import SWITCH_ENV
from trainer_client.batch import pack_padded
from trainer_client.loop import (
    LoopConfig,
    generate,
    policy_gradient_loss,
    to_rollouts,
    train_step,
    trainer,
)
from trainer_client.push import WeightPusher

API_KEY = "chaos-generation-key"
WEIGHTS_TOKEN = "chaos-weights-token"


@dataclass(frozen=True, kw_only=True, slots=True)
class ChaosConfig:
    """One chaos run."""

    workdir: Path
    """Where the service's and Prometheus's configs, logs and data go."""
    draft_noise: float = 0.3
    """The generated drafter's relative noise (``WeightInit.draft_noise``). The RL loop's
    MTP loss trains the drafter during the run, so the healthy level sits above the
    untrained one: greedy, 0.3 gave a control-run macro accept rate of 0.77 (0.22 gave
    0.92, above the 0.6-0.8 of a trained drafter on real data)."""
    num_speculative_tokens: int = 2
    """Draft tokens per step."""
    batch_size: int = 16
    """Prompts per RL step (one sample each)."""
    max_tokens: int = 24
    """Tokens per sample."""
    temperature: float = 0.0
    """Sampling temperature of the rollouts. Greedy: at temperature 1 the tiny model's own
    entropy caps acceptance near 0.3 whatever the drafter, and on CPU speculation there is
    a real slow-down (docs/benchmarks.md), which a healthy control run must not be."""
    lr: float = 1e-5
    """The trainer's learning rate: the policy moves every step, slowly (at 1e-4 and 5e-4
    its greedy answers turned repetitive within a minute and acceptance climbed past
    0.95)."""
    for_s: str = "5s"
    """The ``for`` of the alerts during the run (test-time override)..."""
    unshortened: tuple[str, ...] = ("RolloutSpeculationSlowdown",)
    """...except these, which keep the committed one. No case breaks the speed-up, and on
    this CPU a healthy drafter at this acceptance is about break-even (docs/benchmarks.md):
    the run reports the net speed-up instead."""
    max_seconds: float = 60.0
    """A case's alert must fire within this long after its fault..."""
    max_requests: int = 256
    """...and within this many requests."""
    num_healthy_steps: int = 2
    """Healthy steps before each fault (so the weights before it have drafted)."""
    quiet_timeout_s: float = 240.0
    """How long to restore health (healthy steps) before a case at most."""


# ---- the pieces: checkpoint, Prometheus, the trainer ------------------------------------

@contextlib.contextmanager
def prometheus(workdir: Path, target: str, overrides: dict[str, str]) -> Iterator[str]:
    """A Prometheus scraping ``target`` every second with the rules' ``for`` overridden;
    its URL."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise RuntimeError("the prometheus binary is missing (Debian package 'prometheus')")
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "rules.yml").write_text(rules.render(overrides))
    (workdir / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"rule_files: ['{workdir / 'rules.yml'}']\n"
        "scrape_configs:\n  - job_name: rollout\n    static_configs:\n"
        f"      - targets: ['{target}']\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    child = ChildProcess([binary, f"--config.file={workdir / 'prometheus.yml'}",
                          f"--storage.tsdb.path={workdir / 'data'}",
                          f"--web.listen-address=127.0.0.1:{port}"], workdir / "prometheus.log")
    try:
        wait_until(lambda: httpx.get(f"{url}/-/ready", timeout=2).status_code == 200, child,
                   60, "Prometheus ready")
        yield url
    finally:
        child.stop()


def active_alerts(url: str) -> list[dict[str, Any]]:
    """Prometheus's pending and firing alerts."""
    return httpx.get(f"{url}/api/v1/alerts", timeout=10).json()["data"]["alerts"]


def instant(url: str, query: str) -> float | None:
    """The first value of an instant query (None without one)."""
    result = httpx.get(f"{url}/api/v1/query", params={"query": query},
                       timeout=10).json()["data"]["result"]
    return float(result[0]["value"][1]) if result else None


class Trainer:
    """The RL loop, one step at a time, with a fault applied to a step's push."""

    def __init__(self, cfg: LoopConfig, hf_config: dict[str, Any], pusher: WeightPusher,
                 model: torch.nn.Module, optimizer: torch.optim.Optimizer, version: int) -> None:
        self._cfg, self._hf_config, self._pusher = cfg, hf_config, pusher
        self._model, self._optimizer = model, optimizer
        self.version = version
        self.step_index = 0

    def step(self, fault: Fault, *, on_generated: Callable[[int], None]) -> None:
        """Generate, train, push (as ``fault`` says); ``on_generated(n)`` when the batch is
        back."""
        from trainer_client.megatron.convert import (
            export_dtype,
            export_hf_weights,
            hf_tensor_shapes,
        )

        cfg, step = self._cfg, self.step_index
        self.step_index += 1
        prompts = arithmetic_prompts(cfg.batch_size, seed=cfg.seed * 100_003 + step)
        response = asyncio.run(generate(cfg, [p for p, _ in prompts], step=step))
        on_generated(len(prompts))
        batch = pack_padded(to_rollouts(response, [a for _, a in prompts]), tp=1, cp=1,
                            pad_id=int(self._hf_config["eos_token_id"]))
        losses = train_step(self._model, self._optimizer, batch, self._hf_config, cfg,
                            policy_gradient_loss)
        stats = messages.TrainingStats(version=self.version, mtp_accuracy=losses.mtp_accuracy,
                                       num_tokens=losses.num_tokens)
        self.version += 1
        exported = export_hf_weights(self._model, self._hf_config)
        if fault.transform is not None:
            exported = ((name, fault.transform(name, t)) for name, t in exported)
        dtype = str(export_dtype(self._model, self._hf_config)).removeprefix("torch.")
        specs = [messages.ParamSpec(name=name, shape=list(shape), dtype=dtype)
                 for name, shape in hf_tensor_shapes(self._model, self._hf_config, 1).items()]
        self._pusher.push(exported, version=self.version, target=fault.target, specs=specs,
                          training_stats=stats)


# ---- a case -------------------------------------------------------------------------------

class Run:
    """One service, one Prometheus, one trainer: the cases in turn."""

    def __init__(self, config: ChaosConfig, prometheus_url: str, trainer: Trainer,
                 switch: Path) -> None:
        self.config, self.url, self.trainer, self.switch = config, prometheus_url, trainer, switch

    def _firing(self) -> dict[str, float]:
        """Alert name -> when it started firing (Unix time; ``activeAt`` + ``for``)."""
        wait = _seconds(self.config.for_s)
        return {a["labels"]["alertname"]: _unix(a["activeAt"]) + wait
                for a in active_alerts(self.url) if a["state"] == "firing"
                and a["labels"]["alertname"] not in self.config.unshortened}

    def restore(self) -> None:
        """Healthy steps (at least ``num_healthy_steps``) until no alert is pending or
        firing (but the unshortened ones, which a minute cannot raise)."""
        deadline = time.monotonic() + self.config.quiet_timeout_s

        def active() -> list[str]:
            names = sorted({a["labels"]["alertname"] for a in active_alerts(self.url)})
            return [n for n in names if n not in self.config.unshortened]

        for _ in range(self.config.num_healthy_steps):
            self.trainer.step(Fault(), on_generated=lambda n: None)
        while names := active():
            if time.monotonic() > deadline:
                raise TimeoutError(f"alerts still active after {self.config.quiet_timeout_s:g}"
                                   f" s of healthy steps: {names}")
            self.trainer.step(Fault(), on_generated=lambda n: None)

    def _fired_since(self, start: float) -> list[str]:
        """Every alert that was firing at some point since ``start`` (Prometheus's own
        ``ALERTS`` series, so one that fired and resolved between two looks counts)."""
        window = max(int(time.time() - start) + 1, 1)
        result = httpx.get(f"{self.url}/api/v1/query", timeout=10, params={
            "query": f'max by (alertname) (max_over_time(ALERTS{{alertstate="firing"}}'
                     f'[{window}s]))'}).json()["data"]["result"]
        return sorted(r["metric"]["alertname"] for r in result)

    def case(self, case: Case) -> CaseResult:
        config, result = self.config, CaseResult(case=case)
        self.restore()
        began = time.time()
        finished: list[tuple[float, int]] = []  # (Unix time, requests finished so far)
        count = 0

        def on_generated(num: int) -> None:
            nonlocal count
            if start is not None:
                count += num
                finished.append((time.time(), count))

        start: float | None = None
        if case.fault.stats_outage:
            self.switch.touch()
            start = time.time()
        fired: dict[str, float] = {}
        try:
            while True:
                self.trainer.step(case.fault, on_generated=on_generated)
                if start is None:  # the first broken push has loaded: the fault is on
                    start = time.time()
                fired = self._firing()
                if case.alert in fired or time.time() - start > config.max_seconds \
                        or count >= config.max_requests:
                    break
            # What the last step's data make Prometheus raise, one scrape, one evaluation
            # and the shortened ``for`` later.
            settle = time.time() + _seconds(config.for_s) + 4.0
            while case.alert not in fired and time.time() < settle:
                time.sleep(0.5)
                fired = self._firing()
            result.figures = self._figures()
        finally:
            self.switch.unlink(missing_ok=True)
        result.seconds, result.num_requests = time.time() - start, count
        at = fired.get(case.alert) if case.alert else None
        if at is not None:
            requests = max([n for t, n in finished if t <= at], default=0)
            if at - start <= config.max_seconds and requests <= config.max_requests:
                result.fired_after_s = max(at - start, 0.0)
                result.fired_after_requests = requests
        result.other_alerts = [n for n in self._fired_since(began) if n != case.alert]
        return result

    def _figures(self) -> dict[str, float]:
        from rollout_service.telemetry import queries

        scope = queries.Scope(window="1m")
        wanted = {"macro accept rate (1m)": queries.macro_accept_rate(scope),
                  "net speed-up (1m)": queries.net_speedup(scope),
                  "verify cost ratio": queries.verify_cost_ratio(scope)}
        return {name: value for name, query in wanted.items()
                if (value := instant(self.url, query)) is not None}


def _seconds(duration: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600}
    return float(duration[:-1]) * units[duration[-1]]


def _unix(timestamp: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()


def run_chaos(config: ChaosConfig, cases: tuple[Case, ...] = CASES) -> list[CaseResult]:
    """Start everything, run ``cases`` in order (the stats outage last), stop everything."""
    checkpoint = ensure_model("tiny", init=WeightInit(draft_noise=config.draft_noise))
    hf_config = json.loads((checkpoint / "config.json").read_text())
    switch = config.workdir / "stats-outage"
    switch.unlink(missing_ok=True)
    service_config = config.workdir / "service.json"
    config.workdir.mkdir(parents=True, exist_ok=True)
    service_config.write_text(json.dumps({
        "model": str(checkpoint), "served_model_name": "chaos",
        "engine_kwargs": {"max_model_len": 1024, "enforce_eager": True, "dtype": "float32",
                          "kv_cache_memory_bytes": 512 * 1024**2},
        "mtp": {"num_speculative_tokens": config.num_speculative_tokens},
        "api_key": API_KEY, "weights_token": WEIGHTS_TOKEN}))
    with ServiceProcess(config.workdir / "service.log", config=service_config,
                        env={SWITCH_ENV: str(switch)},
                        module="tests.support.fake_stats_outage") as service:
        service.wait_healthy(timeout_s=600)
        loop = LoopConfig(service_url=service.url, checkpoint=checkpoint,
                          weights_token=WEIGHTS_TOKEN, api_key=API_KEY,
                          batch_size=config.batch_size, max_tokens=config.max_tokens,
                          temperature=config.temperature, lr=config.lr)
        overrides = {alert.name: config.for_s for alert in rules.ALERTS
                     if alert.name not in config.unshortened}
        with prometheus(config.workdir / "prometheus", service.url.removeprefix("http://"),
                        overrides) as url, \
                trainer(loop, hf_config) as (model, optimizer), \
                WeightPusher(service.url, WEIGHTS_TOKEN) as pusher:
            run = Run(config, url, Trainer(loop, hf_config, pusher, model, optimizer,
                                           version=0), switch)
            results = []
            for case in sorted(cases, key=lambda c: c.fault.stats_outage):
                results.append(run.case(case))
                progress(results[-1])
            return results


def progress(result: CaseResult) -> None:
    """One line per finished case (the table comes at the end)."""
    print(f"{result.case.name}: alert {result.case.alert} after {result.fired_after_s} s, "
          f"{result.fired_after_requests} requests; others {result.other_alerts}; "
          f"{result.num_requests} requests in {result.seconds:.0f} s; {result.figures}",
          flush=True)

