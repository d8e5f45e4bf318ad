"""A py-spy profile of a running process, recorded while a benchmark drives it.

``bench.serving --profile-service`` samples the service, ``bench.speculation
--profile-modes`` the service and its engine core; ``bench.profile_summary`` reads what
they wrote.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path


def start_profiler(pid: int, out_dir: Path, name: str = "service", *,
                   subprocesses: bool = False) -> subprocess.Popen[bytes]:
    """py-spy sampling process ``pid`` (with ``subprocesses``, its children too: vLLM's
    engine core) until SIGINT, into ``out_dir/<name>.collapsed.txt``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy")),
         "record", "--pid", str(pid), "--format", "raw", "--rate", "200",
         "--output", str(out_dir / f"{name}.collapsed.txt"), "--threads",
         *(["--subprocesses"] if subprocesses else [])],
        stdout=(out_dir / f"{name}.py-spy.log").open("wb"), stderr=subprocess.STDOUT)


def stop_profiler(profiler: subprocess.Popen[bytes]) -> None:
    """SIGINT, on which py-spy writes its file; wait until it has."""
    profiler.send_signal(signal.SIGINT)
    profiler.wait(timeout=120)
