"""An ASGI app served by uvicorn on loopback, in a thread of the test process: for a FAKE
server a service process must reach over HTTP, or a service app a trainer pushes to."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI

from rollout_service.tools.launch import free_port


@contextmanager
def serving(app: FastAPI) -> Iterator[str]:
    """``app`` under uvicorn on loopback, in a thread; yields its URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)  # poll interval of a deadline loop: uvicorn sets `started`
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
