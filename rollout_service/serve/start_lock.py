"""Engine starts one at a time on a host: replicas that share a GPU (fractional ``num_gpus``).

Runs in each engine replica's actor (``serve/replica.py``), around its engine's start.
The replicas talk to each other only through the lock file: an exclusive ``flock`` on it,
which the kernel releases when its holder closes the file or dies, so a replica killed
mid-start never blocks the next one.

Why: vLLM sizes its KV cache from the whole device's free memory, measured before and after
its profile run (``Worker.determine_available_memory``). An engine starting beside another
on the same GPU counts what the other allocates meanwhile as its own (a smaller cache, or
"No available memory for the cache blocks": vllm-project/vllm#55827, open), and fails an
assertion if the other frees memory meanwhile ("Error in memory profiling":
vllm-project/vllm#56830). Ray Serve starts a deployment's replicas together.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

logger = logging.getLogger(__name__)


@asynccontextmanager
async def one_start_at_a_time(path: Path | None) -> AsyncIterator[None]:
    """Hold the lock at ``path`` for the block (nothing when ``path`` is None).

    The wait runs in a thread, so the replica's event loop goes on serving Ray's calls.
    """
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        start = time.monotonic()
        await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
        logger.info("engine start lock %s held after %.1f s", path, time.monotonic() - start)
        yield
    finally:
        os.close(fd)  # releases the lock
