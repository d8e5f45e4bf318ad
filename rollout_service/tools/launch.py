"""Run servers as child processes and stop them again: the service, or any command.

Used by the demos, the benchmarks and the tests: the service runs exactly as in
production (its own process, its own engine), and the caller talks HTTP to it.
:func:`free_port` is the one free-port helper of the repository.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import httpx


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def stop_children_on_sigterm() -> None:
    """Make SIGTERM unwind this process as Ctrl-C does (once; main thread only).

    ``timeout`` and job schedulers stop a run with SIGTERM, whose default action ends
    Python at once, skipping every ``finally``. The children below run in their own
    sessions (so that :meth:`ChildProcess.stop` can end their groups) and would outlive
    it, engines and GPU memory included: on the GPU machine a test run stopped by
    ``timeout`` left its service holding an engine that never finished starting, and
    the next runs shared the GPU with it. As a KeyboardInterrupt, SIGTERM runs the
    ``with`` blocks and fixtures that stop them. A handler someone else installed is
    left alone.
    """
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
        signal.signal(signal.SIGTERM, _interrupt)


class ChildProcess:
    """A command in its own process group, its output in ``log_path``.

    :meth:`stop` ends the whole group (an engine's worker processes too): SIGTERM
    to the leader first when ``graceful_leader`` (it shuts its children down in
    order), then SIGTERM to the group, then SIGKILL to what is left. A SIGTERM to
    this process stops them too (:func:`stop_children_on_sigterm`), when the caller
    stops them in a ``with`` block or ``finally``.
    """

    def __init__(self, args: list[str], log_path: Path, *, env: dict[str, str] | None = None,
                 graceful_leader: bool = False, cwd: Path | None = None) -> None:
        self.args = args
        self.log_path = log_path
        self._graceful_leader = graceful_leader
        stop_children_on_sigterm()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("wb") as log:
            self._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                          env=env, cwd=cwd, start_new_session=True)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def is_alive(self) -> bool:
        return self._proc.poll() is None

    def log_tail(self, num_lines: int = 60) -> str:
        """The last lines of the child's log."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-num_lines:])

    def stop(self, timeout_s: float = 30.0) -> None:
        """End the process group; returns once nothing of it is alive."""
        if self._proc.poll() is not None and not group_alive(self._proc.pid):
            return
        pgid = self._proc.pid  # start_new_session: the leader's pid is the group's id
        if self._graceful_leader and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            self._proc.wait()
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and group_alive(pgid):
            try:
                self._proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
            if self._proc.poll() is not None:  # the leader is gone; what it left may linger
                time.sleep(0.2)
        if group_alive(pgid):
            os.killpg(pgid, signal.SIGKILL)
        self._proc.wait()


def wait_until(probe: Callable[[], bool], child: ChildProcess, timeout_s: float,
               what: str) -> None:
    """Poll ``probe`` every 0.5 s until it holds.

    Raises:
        RuntimeError: the child exited first (the log's tail is in the message).
        TimeoutError: not within ``timeout_s`` (same).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if not child.is_alive():
            raise RuntimeError(f"{' '.join(child.args[:4])} exited before {what}:\n"
                               f"{child.log_tail()}")
        try:
            if probe():
                return
        except (httpx.TransportError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"not {what} after {timeout_s:.0f} s:\n{child.log_tail()}")
        time.sleep(0.5)


def wait_http_ok(url: str, child: ChildProcess, timeout_s: float) -> None:
    """Wait until ``GET url`` answers 200 (e.g. vLLM's own ``/health``)."""
    wait_until(lambda: httpx.get(url, timeout=30).status_code == 200, child, timeout_s,
               f"{url} answered 200")


ADDRESS_IN_USE = "address already in use"
"""What a service whose port is taken logs (any case): the CLI's refusal, uvicorn's."""
MAX_STARTS = 3
"""Starts of a service whose port was taken, on a new port each time."""


class ServiceProcess:
    """``with ServiceProcess(...) as proc:`` runs the service until the block ends.

    Args:
        log_path: where the child's stdout and stderr go.
        config: optional config file passed as ``--config``.
        model: optional ``--model`` override.
        env: extra environment variables for the child.
        command: the CLI command, ``serve`` or ``serve-ray``.
        extra_args: more arguments for it.
        module: the module run with ``python -m`` (a test's wrapper of the CLI, e.g.
            ``tests.support.fake_stats_outage``); default the CLI itself.
    """

    def __init__(self, log_path: Path, *, config: Path | None = None, model: str | None = None,
                 env: dict[str, str] | None = None, command: str = "serve",
                 extra_args: tuple[str, ...] = (),
                 module: str = "rollout_service.cli") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._command = command
        self._args = [sys.executable, "-m", module, command, "--host", "127.0.0.1",
                      *extra_args]
        if config is not None:
            self._args += ["--config", str(config)]
        if model is not None:
            self._args += ["--model", model]
        self._env = {**os.environ, **(env or {})}
        self._child: ChildProcess | None = None

    def __enter__(self) -> ServiceProcess:
        self._start()
        return self

    def _start(self) -> None:
        # serve-ray first gets SIGTERM alone: it shuts Serve and Ray down in order.
        self._child = ChildProcess([*self._args, "--port", str(self.port)], self.log_path,
                                   env=self._env, graceful_leader=self._command == "serve-ray")

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    @property
    def child(self) -> ChildProcess:
        assert self._child is not None, "use ServiceProcess as a context manager"
        return self._child

    def is_alive(self) -> bool:
        return self._child is not None and self._child.is_alive()

    def wait_healthy(self, timeout_s: float = 600.0) -> None:
        """Poll ``/health`` until its status is ``ok`` (every replica serving, for
        ``serve-ray``).

        Raises:
            RuntimeError: the process exited first (the log's tail is in the message).
            TimeoutError: not healthy within ``timeout_s`` (same).
        """
        for start in range(1, MAX_STARTS + 1):
            try:
                wait_until(lambda: httpx.get(f"{self.url}/health", timeout=30).json().get(
                    "status") == "ok", self.child, timeout_s, "healthy")
                return
            except RuntimeError as exc:
                # The port was free when chosen, and another process on the machine (a
                # second test run) took it before the service bound it. Start again on
                # another port.
                if ADDRESS_IN_USE not in str(exc).lower() or start == MAX_STARTS:
                    raise
                self.child.stop()
                self.port = free_port()
                self.url = f"http://127.0.0.1:{self.port}"
                self._start()

    def log_tail(self, num_lines: int = 60) -> str:
        """The last lines of the child's log."""
        return self.child.log_tail(num_lines)

    def stop(self, timeout_s: float = 30.0) -> None:
        """End the service and everything it started."""
        if self._child is not None:
            self._child.stop(timeout_s)


def group_alive(pgid: int) -> bool:
    """Whether a live (non-zombie) process is left in group ``pgid`` (Linux /proc)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False
