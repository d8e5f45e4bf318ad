"""The service's log: its own INFO lines, not httpx's line per HTTP call to the engine."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from rollout_service.cli import configure_logging


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
