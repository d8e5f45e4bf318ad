"""Launch and stop an SGLang server as a subprocess of the rollout service.

Runs in the rollout service process when no ``engine_url`` is given: it starts
``python -m sglang.launch_server`` in its own session (the server spawns its scheduler
and TP worker processes) on a free port below the kernel's ephemeral range (a port
handed out by ``bind(0)`` can be taken by an outgoing connection in the half minute
before the server binds it; SGLang picks its own NCCL port the same way), polls its
``/health`` over HTTP until it serves, and stops it on shutdown. The speculative arguments come from
:func:`rollout_service.engines.speculative.build_sglang_server_args`; every other
argument is the user's ``engine_kwargs``, passed through.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import socket
import sys
import time
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from rollout_service.engines.base import EngineUnavailableError
from rollout_service.engines.sglang.http_client import ServerHTTP
from rollout_service.engines.speculative import MTPSettings, build_sglang_server_args

logger = logging.getLogger(__name__)

LAUNCH_MODULE = "sglang.launch_server"
"""The module the service runs as SGLang's server (``python -m``)."""

_RESERVED = ("model_path", "host", "port")
_STOP_TIMEOUT_S = 60.0
_PORT_RANGE = (20000, 29999)
"""Where :func:`free_port_below_ephemeral` looks (Linux's ephemeral range starts at 32768)."""


def free_port_below_ephemeral(host: str = "127.0.0.1", attempts: int = 64) -> int:
    """A port free on ``host`` now and outside the ephemeral range, where no outgoing
    connection takes it before the server binds it.

    Raises:
        OSError: no free port among ``attempts`` random ones of the range.
    """
    for port in random.sample(range(_PORT_RANGE[0], _PORT_RANGE[1] + 1), attempts):
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port in {_PORT_RANGE} after {attempts} attempts")


def build_launch_command(model_path: str, engine_kwargs: Mapping[str, Any], mtp: MTPSettings, *,
                         host: str, port: int, python: str = sys.executable) -> list[str]:
    """``python -m sglang.launch_server`` with the MTP arguments and the user's kwargs.

    Each kwarg ``name`` becomes ``--name-with-dashes``: True is a bare flag, False and
    None are left out (SGLang's boolean flags are switches, off by default), a list gives
    several values, a mapping its JSON, anything else its ``str``.

    Raises:
        ValueError: a bad speculative setting, or ``engine_kwargs`` setting ``model_path``,
            ``host`` or ``port`` (the service sets those).
    """
    reserved = [key for key in _RESERVED if key in engine_kwargs]
    if reserved:
        raise ValueError(f"engine_kwargs: {reserved} are set by the service (model, host, "
                         "port), not by engine_kwargs")
    speculative = build_sglang_server_args(mtp, engine_kwargs)
    user = {key: value for key, value in engine_kwargs.items() if key not in speculative}
    args = {"model_path": model_path, "host": host, "port": port, **user, **speculative}
    command = [python, "-m", LAUNCH_MODULE]
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            command.append(flag)
        elif isinstance(value, (list, tuple)):
            command += [flag, *map(str, value)]
        elif isinstance(value, Mapping):
            command += [flag, json.dumps(value)]
        else:
            command += [flag, str(value)]
    return command


SERVICE_SERVER_ARGS: Mapping[str, Any] = MappingProxyType({"log_level_http": "warning"})
"""What a server the service launches gets under the user's ``engine_kwargs`` (which win).

``log_level_http: warning`` keeps the server's uvicorn from logging each request: the
service logs every client request itself (``http_access_log``), and a second line per
request would be written on the event loop that also runs SGLang's tokenizer manager,
which every request of a burst passes through. SGLang's own loggers, the scheduler's
batch lines among them, keep ``log_level``."""


def service_launch_command(model_path: str, engine_kwargs: Mapping[str, Any], mtp: MTPSettings,
                           *, host: str, port: int) -> list[str]:
    """The command the service runs: :func:`build_launch_command` with
    :data:`SERVICE_SERVER_ARGS` under the user's kwargs."""
    return build_launch_command(model_path, {**SERVICE_SERVER_ARGS, **engine_kwargs}, mtp,
                                host=host, port=port)


async def start_server(command: list[str], http: ServerHTTP, *,
                       startup_timeout_s: float) -> asyncio.subprocess.Process:
    """Run ``command`` in its own session and return once the server ``http`` reaches is
    healthy (the engine's own client, whose pool it then keeps).

    Raises:
        EngineUnavailableError: the server exited or was not healthy in time (it is
            stopped then).
    """
    logger.info("launching SGLang: %s", " ".join(command))
    process = await asyncio.create_subprocess_exec(*command, start_new_session=True)
    try:
        await _wait_healthy(http, process, startup_timeout_s)
    except BaseException:
        await stop_process(process)
        raise
    return process


async def stop_process(process: asyncio.subprocess.Process) -> None:
    """SIGTERM the server (it stops its own children), then kill its session."""
    if process.returncode is None:
        process.terminate()
        try:
            await asyncio.wait_for(process.wait(), _STOP_TIMEOUT_S)
        except TimeoutError:
            os.killpg(process.pid, signal.SIGKILL)
            await process.wait()


async def _wait_healthy(http: ServerHTTP, process: asyncio.subprocess.Process,
                        timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.returncode is not None:
            raise EngineUnavailableError(f"SGLang exited with code {process.returncode}")
        try:
            if (await http.send("GET", "/health", timeout=5.0)).status == 200:
                return
        except EngineUnavailableError:
            pass  # not listening yet
        await asyncio.sleep(2.0)  # a poll interval, under the deadline above
    raise EngineUnavailableError(f"SGLang was not healthy within {timeout_s} s")
