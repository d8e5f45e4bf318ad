"""A deadline on an engine's start, so that a start that hangs ends with an error.

vLLM's front end waits for its engine-core process without a deadline
(``vllm/v1/engine/utils.py::wait_for_engine_startup`` in vLLM 0.32; a start timeout is
vllm-project/vllm PR #50039, open), so a stall in that process is a service that never
comes up and never says why. On an H200 an engine core was seen blocked, for good,
allocating pinned host memory (``UvaBuffer`` of the V2 model runner;
docs/what-ran-where.md). The start runs in the event loop's thread and blocks it, so
the deadline is kept by a thread of its own: when it passes, the processes the start
created are killed, which makes the engine's own start fail (vLLM raises "Engine core
initialization failed"), and the caller reports the deadline instead. A start stuck in
this process itself, with no child to kill, ends the process after a grace period: a
replica that cannot start is better restarted by its supervisor than left hanging.
"""

from __future__ import annotations

import logging
import os
import threading
from types import TracebackType

import psutil

logger = logging.getLogger(__name__)

GRACE_S = 60.0
"""How long a start may still take after its processes were killed before this process
exits (the engine's own cleanup after a dead child takes seconds)."""


class EngineStartTimeout(RuntimeError):
    """The engine did not start within ``engine_start_timeout_s``."""


class StartDeadline:
    """``with StartDeadline(timeout_s): start()``: kill what the start spawned if it runs
    past ``timeout_s`` (None: no deadline).

    Raises (on leaving the block):
        EngineStartTimeout: the deadline passed; the block's own error is its cause.
    """

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self.expired = False
        self._finished = threading.Event()
        self._lock = threading.Lock()
        self._before: set[int] = set()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> StartDeadline:
        if self.timeout_s is not None:
            self._before = {p.pid for p in psutil.Process().children(recursive=True)}
            self._thread = threading.Thread(target=self._watch, name="engine-start-deadline",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        with self._lock:
            self._finished.set()
        if self._thread is not None:
            self._thread.join()
        if self.expired:
            self._kill_new_children()  # a start that ended as the deadline passed, too
            raise EngineStartTimeout(
                f"engine_start_timeout_s: the engine did not start within "
                f"{self.timeout_s:g} s, so its processes were stopped; raise the limit if "
                f"starts are this slow (large checkpoints, torch.compile)") from exc

    def _watch(self) -> None:
        assert self.timeout_s is not None
        if self._finished.wait(self.timeout_s):
            return
        with self._lock:  # a start that ended just now keeps its processes
            if self._finished.is_set():
                return
            self.expired = True
        logger.error("the engine did not start within %g s (engine_start_timeout_s): "
                     "stopping the processes it started", self.timeout_s)
        waited = 0.0
        while not self._finished.wait(0.5):  # the start may spawn more while it runs
            self._kill_new_children()
            waited += 0.5
            if waited >= GRACE_S:
                logger.critical("the engine's start still blocks %.0f s after its processes "
                                "were stopped: exiting", GRACE_S)
                logging.shutdown()
                os._exit(3)

    def _kill_new_children(self) -> None:
        """Kill this process's descendants that were not there when the start began."""
        for child in psutil.Process().children(recursive=True):
            if child.pid not in self._before:
                try:
                    child.kill()
                except psutil.NoSuchProcess:
                    pass
