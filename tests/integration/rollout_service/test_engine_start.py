"""An engine start past ``engine_start_timeout_s`` ends the service with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_service.tools.launch import ServiceProcess, group_alive
from tests.integration.conftest import service_config


def test_a_start_past_its_deadline_stops_the_engine_and_names_the_field(
        tmp_path: Path) -> None:
    # One second: the embedded model's engine needs far longer to start on any machine.
    config = service_config(tmp_path, engine_start_timeout_s=1.0)
    with ServiceProcess(tmp_path / "service.log", config=config) as proc:
        with pytest.raises(RuntimeError, match="exited before healthy"):
            proc.wait_healthy(timeout_s=300)
        log = proc.log_tail(300)
        assert ("engine_start_timeout_s: the engine did not start within 1 s, so its "
                "processes were stopped") in log
        # The service and the engine process it had forked: all gone, none left behind.
        assert not group_alive(proc.child.pid)
