"""The service's log (its own INFO lines, not httpx's line per HTTP call to the engine) and
its uvicorn config."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

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
