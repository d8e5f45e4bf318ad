"""Start ``rollout-service serve`` as a child process and stop it again.

Used by the demo, the benchmarks and the tests: the service runs exactly as in
production (its own process, its own engine), and the caller talks HTTP to it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import httpx


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServiceProcess:
    """``with ServiceProcess(...) as proc:`` runs the service until the block ends.

    Args:
        log_path: where the child's stdout and stderr go.
        config: optional config file passed as ``--config``.
        model: optional ``--model`` override.
        env: extra environment variables for the child.
        command: the CLI command, ``serve`` or ``serve-ray``.
        extra_args: more arguments for it.
    """

    def __init__(self, log_path: Path, *, config: Path | None = None, model: str | None = None,
                 env: dict[str, str] | None = None, command: str = "serve",
                 extra_args: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._args = [sys.executable, "-m", "rollout_service.cli", command,
                      "--host", "127.0.0.1", "--port", str(self.port), *extra_args]
        if config is not None:
            self._args += ["--config", str(config)]
        if model is not None:
            self._args += ["--model", model]
        self._env = {**os.environ, **(env or {})}
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ServiceProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        self._proc = subprocess.Popen(self._args, stdout=log, stderr=subprocess.STDOUT,
                                      env=self._env, start_new_session=True)
        log.close()
        return self

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def wait_healthy(self, timeout_s: float = 600.0) -> None:
        """Poll ``/health`` until its status is ``ok`` (every replica serving, for
        ``serve-ray``).

        Raises:
            RuntimeError: the process exited first (the log's tail is in the message).
            TimeoutError: not healthy within ``timeout_s`` (same).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.is_alive():
                raise RuntimeError(f"{self._args[3]} exited before it became healthy:\n"
                                   f"{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=30).json().get("status") == "ok":
                    return
            except (httpx.TransportError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.url} not healthy after {timeout_s:.0f} s:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.5)

    def log_tail(self, num_lines: int = 60) -> str:
        """The last lines of the child's log."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-num_lines:])

    @property
    def returncode(self) -> int | None:
        assert self._proc is not None
        return self._proc.poll()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the whole process group (engine workers too), then SIGKILL.

        ``serve-ray`` first gets SIGTERM alone, so it can shut Serve and Ray down
        in order before anything left in its group is killed.
        """
        if self._proc is None or self._proc.poll() is not None:
            return
        pgid = os.getpgid(self._proc.pid)
        if self._args[3] == "serve-ray":
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and _group_alive(pgid):
            if self._proc.poll() is None:
                try:
                    self._proc.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    pass
            else:  # the leader is gone; what it left behind may linger (Ray's agents)
                time.sleep(0.2)
        if _group_alive(pgid):
            os.killpg(pgid, signal.SIGKILL)
        self._proc.wait()


def _group_alive(pgid: int) -> bool:
    """Whether a live (non-zombie) process is left in group ``pgid`` (Linux /proc)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False
