"""The service's log (its own INFO lines, not httpx's line per HTTP call to the engine) and
its uvicorn config."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout_service import cli
from rollout_service.cli import configure_logging, server_config


@pytest.fixture
def httpx_logger() -> Iterator[logging.Logger]:
    logger = logging.getLogger("httpx")
    level = logger.level
    yield logger
    logger.setLevel(level)


def test_httpx_logs_failures_only(httpx_logger: logging.Logger,
                                  caplog: pytest.LogCaptureFixture) -> None:
    configure_logging()
    with caplog.at_level(logging.INFO):
        logging.getLogger("rollout_service.service").info("service line")
        httpx_logger.info('HTTP Request: POST http://engine/generate "HTTP/1.1 200 OK"')
        httpx_logger.warning("engine call failed")
    assert [r.getMessage() for r in caplog.records] == ["service line", "engine call failed"]


def test_the_service_serves_with_the_c_http_parser_and_uvloop() -> None:
    """uvicorn's ``auto`` would take h11 and asyncio's loop where these are missing."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    config = server_config(object(), keep_alive_s=4.0)
    config.load()
    assert config.http_protocol_class is HttpToolsProtocol
    assert config.get_loop_factory().__module__.startswith("uvloop")
    assert config.timeout_keep_alive == 4.0


@pytest.mark.parametrize("http_access_log", [True, False])
def test_serve_runs_uvicorn_with_the_configs_access_log(
        http_access_log: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``http_access_log`` reaches uvicorn (its line per request; on by default, as in
    ``vllm serve``). uvicorn's server is recorded instead of run: no engine starts."""
    import uvicorn

    served: list[uvicorn.Config] = []

    class Recorded:
        def __init__(self, config: uvicorn.Config) -> None:
            served.append(config)

        def run(self, sockets: list[socket.socket]) -> None:
            for sock in sockets:
                sock.close()

    monkeypatch.setattr(uvicorn, "Server", Recorded)
    config = tmp_path / "service.yaml"
    config.write_text(f"model: embedded:tiny\nhttp_access_log: {str(http_access_log).lower()}\n")
    cli.app(["serve", "--config", str(config), "--port", "0"], standalone_mode=False)
    assert [c.access_log for c in served] == [http_access_log]
    assert server_config(object(), keep_alive_s=4.0).access_log is True  # the default
