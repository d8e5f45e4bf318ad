"""The launch helpers: children end when their parent is stopped with SIGTERM, and a
service whose port was taken before it bound it starts again on another port (a fake CLI
that only answers ``/health``: ``tests/support/health_only_server.py``)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from rollout_service.tools.launch import ServiceProcess

PARENT = """
import signal, sys, time
from pathlib import Path
from rollout_service.tools.launch import ChildProcess

child = ChildProcess([sys.executable, "-c", "import time; time.sleep(600)"],
                     Path(sys.argv[1]) / "child.log")
if sys.argv[2] == "default-sigterm":
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
try:
    print(child.pid, flush=True)
    time.sleep(600)
finally:
    child.stop()
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("handler", ["launch", "default-sigterm"])
def test_sigterm_to_the_parent_stops_its_child(tmp_path: Path, handler: str) -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path), handler],
                              stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())  # the child runs from here on
    try:
        parent.send_signal(signal.SIGTERM)
        parent.wait(timeout=60)
        # Python's default SIGTERM ends the parent at once, its child left running:
        # what the launch helpers' handler exists to prevent.
        assert alive(child) == (handler == "default-sigterm")
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)
        parent.kill()


def test_a_service_whose_port_is_taken_starts_again_on_another(tmp_path: Path) -> None:
    proc = ServiceProcess(tmp_path / "service.log", module="tests.support.health_only_server")
    taken = proc.port
    with socket.socket() as squatter:  # another process's socket on the chosen port
        squatter.bind(("127.0.0.1", taken))  # bound, not listening: probes are refused
        with proc:
            proc.wait_healthy(timeout_s=60)
            assert proc.port != taken
            assert httpx.get(f"{proc.url}/health", timeout=10).json() == {"status": "ok"}
