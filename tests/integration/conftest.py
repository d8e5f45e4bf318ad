"""Session fixtures: one real service process (vLLM engine), one real Prometheus.

Starting vLLM costs ~20-40 s on two cores, so the whole session shares one
service. It runs with an API key and two speculative tokens (so per-position
acceptance has two positions), exactly as ``rollout-service serve`` runs. Tests
of another configuration start their own with :func:`run_service` (once per
module).

``ROLLOUT_TEST_TARGET`` picks where the same tests run: ``cpu`` (default: vLLM's
CPU build, shm pushes), ``cuda-shm`` or ``cuda-ipc`` (vLLM's CUDA build on GPU 0,
pushes through shared memory or CUDA IPC handles from this process's GPU tensors,
copied into the served parameters in place), ``cuda-ipc-reload`` (the same with
vLLM's layerwise reload), ``cuda-ipc-k1`` (``cuda-ipc`` with one draft token, not two),
``cuda-graphs`` (``cuda-ipc`` with vLLM's compile and CUDA graphs), ``sglang`` (an SGLang
server the service launches on GPU 0, shm pushes; ``sglang_target.py`` says which tests
apply there and why the others do not).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.sglang_server import EAGER_SERVER_ARGS
from rollout_service.tools.launch import ServiceProcess, free_port
from tests.integration.sglang_target import sglang_skip_reason
from tests.support.waiting import until, wait_for

__all__ = ["until", "wait_for"]  # re-exported: the integration tests import them from here

API_KEY = "test-generation-key"
WEIGHTS_TOKEN = "test-weights-token"
VANISHED_TRAINER_TIMEOUT_S = 3.0
"""The push timeout the vanished-trainer test asks for in its begin (``timeout_s``). The
session service keeps the default (60 s): with 3 s for every push, a trainer starved for
3 s on the busy 2-core CI machine had its push aborted mid-stream (the CI of 66ae4e9)."""
CATEGORIES = ["math", "code"]
"""The session service's allow-list of request categories (the fuzzer's land in 'other')."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Target:
    """Where the session's service runs and how the tests push to it."""

    engine_kwargs: dict[str, Any]
    """Added to the embedded defaults."""
    transport: str
    """The service's ``weights_transport`` and the tests' pusher's."""
    tensor_device: str
    """Where the tests keep the tensors they push."""
    weights_load: str = "auto"
    """The service's ``weights_load`` (on CUDA, ``auto`` copies pushes in place)."""
    num_speculative_tokens: int = 2
    """MTP draft tokens of the session's service (two: per-position acceptance has two
    positions)."""
    engine_start_timeout_s: float = 600.0
    """The service's: a start that blocks ends the run with the reason, not a silent
    wait (the 2-core CPU machine needs tens of seconds; an eager H200 engine, seconds)."""
    engine: str = "vllm"
    """The service's ``engine``; ``sglang`` launches ``sglang.launch_server`` with
    ``engine_kwargs`` as its server arguments."""


TARGETS = {
    "cpu": Target(engine_kwargs={}, transport="shm", tensor_device="cpu"),
    # float32 on the GPU too: greedy outputs compared across pushes must not flip on
    # bf16 near-ties; eager mode starts in seconds (graphs are the benchmarks' business).
    "cuda-shm": Target(engine_kwargs={"gpu_memory_utilization": 0.2, "enforce_eager": True},
                       transport="shm", tensor_device="cpu", engine_start_timeout_s=180),
    "cuda-ipc": Target(engine_kwargs={"gpu_memory_utilization": 0.2, "enforce_eager": True},
                       transport="cuda_ipc", tensor_device="cuda", engine_start_timeout_s=180),
    "cuda-ipc-k1": Target(engine_kwargs={"gpu_memory_utilization": 0.2, "enforce_eager": True},
                          transport="cuda_ipc", tensor_device="cuda", num_speculative_tokens=1,
                          engine_start_timeout_s=180),
    # The layerwise reload on CUDA: the same tests prove both loads restore the
    # checkpoint bit for bit and change outputs the same way.
    "cuda-ipc-reload": Target(engine_kwargs={"gpu_memory_utilization": 0.2,
                                             "enforce_eager": True},
                              transport="cuda_ipc", tensor_device="cuda",
                              weights_load="reload", engine_start_timeout_s=180),
    # vLLM's compile and CUDA graphs, as served: the graphs are captured per K of the
    # start-up schedule, so a run-time K schedule needs them under test
    # (test_speculation_control.py).
    "cuda-graphs": Target(engine_kwargs={"gpu_memory_utilization": 0.2},
                          transport="cuda_ipc", tensor_device="cuda",
                          engine_start_timeout_s=400),
    # SGLang 0.5.23 on the GPU (the sglang bundle): the checkpoint's bf16, eager, FA3.
    "sglang": Target(engine="sglang", engine_kwargs=EAGER_SERVER_ARGS, transport="shm",
                     tensor_device="cpu", engine_start_timeout_s=300),
}
TARGET = TARGETS[os.environ.get("ROLLOUT_TEST_TARGET", "cpu")]
NUM_SPECULATIVE_TOKENS = TARGET.num_speculative_tokens
shm_only = pytest.mark.skipif(TARGET.transport != "shm",
                              reason="a test of the shm transport's segment")


def service_config(workdir: Path, **changes: Any) -> Path:
    """The config file of a service on the embedded tiny model for :data:`TARGET`.

    Args:
        workdir: where it goes.
        changes: config fields replacing the session's (e.g. ``mtp``).
    """
    config = workdir / "service.json"
    config.write_text(json.dumps({
        "model": "embedded:tiny",
        "engine": TARGET.engine,
        "engine_kwargs": TARGET.engine_kwargs,
        "mtp": {"num_speculative_tokens": NUM_SPECULATIVE_TOKENS},
        "api_key": API_KEY,
        "weights_token": WEIGHTS_TOKEN,
        "weights_transport": TARGET.transport,
        "weights_load": TARGET.weights_load,
        "engine_start_timeout_s": TARGET.engine_start_timeout_s,
        "telemetry": {"categories": CATEGORIES},
        **changes,
    }))
    return config


@contextmanager
def run_service(workdir: Path, **changes: Any) -> Iterator[ServiceProcess]:
    """A service from :func:`service_config`, up and healthy, its log in ``workdir``."""
    with ServiceProcess(workdir / "service.log",
                        config=service_config(workdir, **changes)) as proc:
        proc.wait_healthy(timeout_s=600)
        yield proc


RAY_REPLICA_OPTIONS = {"num_cpus": 1, "runtime_env": {"env_vars": {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}}}
"""CPU engine replicas sharing the 2-core host: one OpenMP thread each, no core binding."""


@contextmanager
def run_ray_service(workdir: Path, config: dict[str, Any]) -> Iterator[ServiceProcess]:
    """``rollout-service serve-ray`` (a local Ray with 2 CPUs) with ``config``, every
    replica serving, as a user starts it."""
    path = workdir / "serve.json"
    path.write_text(json.dumps(config))
    with ServiceProcess(workdir / "serve.log", config=path, command="serve-ray",
                        extra_args=("--num-cpus", "2")) as proc:
        proc.wait_healthy(timeout_s=600)
        yield proc


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """On the ``sglang`` target, skip what does not apply there, with the reason."""
    if TARGET.engine != "sglang":
        return
    for item in items:
        reason = sglang_skip_reason(item.nodeid)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=f"sglang target: {reason}"))


@pytest.fixture(scope="session")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    """The rollout service on the embedded tiny model, up and healthy."""
    with run_service(tmp_path_factory.mktemp("service")) as proc:
        yield proc


def weights_status(service: ServiceProcess):  # noqa: ANN201 - messages.WeightStatus, lazily
    """``GET /weights/status`` of the session's service."""
    from rollout_service.protocol import messages

    response = httpx.get(f"{service.url}/weights/status", timeout=60,
                         headers={"authorization": f"Bearer {WEIGHTS_TOKEN}"})
    return messages.WeightStatus.model_validate(response.json())


def weights_checksums(service: ServiceProcess) -> dict[str, str]:
    """SHA-256 of the served main model's and drafter's parameters."""
    response = httpx.get(f"{service.url}/weights/checksums", timeout=60,
                         headers={"authorization": f"Bearer {WEIGHTS_TOKEN}"})
    return response.json()


def served_version(service: ServiceProcess) -> int:
    """The newest served version of main or drafter (0 before any push)."""
    return weights_status(service).newest_version


def _tail(path: Path, num_lines: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])


@pytest.fixture
async def client(service: ServiceProcess):  # noqa: ANN201 - RolloutClient, imported lazily
    # Lazy: the GPU machine runs the trainer tests without the service's dependencies.
    from rollout_service.client import RolloutClient

    async with RolloutClient(service.url, api_key=API_KEY) as c:
        yield c


@pytest.fixture(scope="session")
def prometheus(service: ServiceProcess, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[str]:
    """A real Prometheus server scraping the service every second; yields its URL.

    `make test` installs the Debian package; without it this fails, not skips:
    the telemetry claims are only proven against a real Prometheus.
    """
    target = service.url.removeprefix("http://")
    scrape = ("  - job_name: rollout\n    static_configs:\n"
              f"      - targets: ['{target}']\n")
    with run_prometheus(tmp_path_factory.mktemp("prometheus"), scrape) as url:
        yield url


@contextmanager
def run_prometheus(workdir: Path, scrape_configs: str) -> Iterator[str]:
    """Run Prometheus (1 s scrapes) with these ``scrape_configs`` entries; yields its URL."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("the prometheus binary is missing: run the tests with `make test`, "
                    "which installs it (Debian package 'prometheus')")
    (workdir / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"scrape_configs:\n{scrape_configs}")
    port = free_port()
    log = (workdir / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [binary, f"--config.file={workdir / 'prometheus.yml'}",
         f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"prometheus did not start:\n{_tail(workdir / 'prometheus.log')}")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
