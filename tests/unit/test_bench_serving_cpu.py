"""What ``bench/serving.py`` charges a round: its front end's CPU and, behind a service, the
SGLang server's front end, per request (real child processes; the CPU is theirs, not
this process's, so a busy machine slows the test but does not change what it reads)."""

from __future__ import annotations

import asyncio
import io
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from rich.console import Console

from bench.serving_measure import FrontEnd, measure
from bench.serving_sglang import launched_server_pid

BURN_S = 0.2
"""CPU seconds the fake front end burns per round, by its own process clock."""

BURNER = f"""
import sys, time
for _ in sys.stdin:
    start = time.process_time()
    while time.process_time() - start < {BURN_S}:
        pass
    print(1, flush=True)
"""
IDLE = "import sys; sys.stdin.read()"


def child(code: str, *argv: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code, *argv],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait()


async def test_a_round_is_charged_its_front_ends_cpu_per_request(
        children: list[subprocess.Popen[bytes]]) -> None:
    burner, idle = child(BURNER), child(IDLE)
    children += [burner, idle]
    num_requests = 8

    async def one_round(concurrency: int, count: int) -> int:
        assert burner.stdin is not None and burner.stdout is not None
        burner.stdin.write(b"go\n")
        burner.stdin.flush()
        await asyncio.to_thread(burner.stdout.readline)
        return 10 * count

    rates = await measure({"service": one_round, "sglang-server": one_round},
                          {"service": FrontEnd((burner.pid,), engine_pid=idle.pid),
                           "sglang-server": FrontEnd((burner.pid,))},
                          concurrency=4, num_requests=num_requests, num_rounds=2,
                          console=Console(file=io.StringIO()))
    per_request_ms = 1e3 * BURN_S / num_requests
    assert all(ms >= 0.9 * per_request_ms for ms in rates.front_end_ms("service"))
    engine_ms = rates.engine_front_end_ms("service")
    assert engine_ms is not None and all(ms < 0.2 * per_request_ms for ms in engine_ms)
    assert rates.engine_front_end_ms("sglang-server") is None  # no engine front end, not 0
    assert len(rates.by_mode["service"]) == 2


def test_the_sglang_server_a_service_launched_is_found_among_its_children(
        children: list[subprocess.Popen[bytes]]) -> None:
    other, server = child(IDLE, "vllm"), child(IDLE, "-m", "sglang.launch_server")
    children += [other, server]
    assert launched_server_pid(os.getpid()) == server.pid
    assert launched_server_pid(other.pid) is None
