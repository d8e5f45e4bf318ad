"""Children of the launch helpers end when their parent is stopped with SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

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
