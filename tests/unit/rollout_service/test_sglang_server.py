"""SGLang engine against the FAKE SGLang server (``fake_sglang``): what the engine learns
from the server, its health, and the server it launches. SGLang cannot serve here.

Everything below runs against the fake, in this process, over httpx's ASGI transport;
nothing here has run against a live SGLang server. Covered: the engine's info from
``/model_info``, ``/server_info`` and ``/v1/models`` (and whose drafter a push can
reach), the launch command built from the service's settings, the features read from the
server's routes and request fields (with and without its OpenAPI document), health, an
unreachable server, a launched server that exits, and the start's health polls.
"""

from __future__ import annotations

import importlib.util
import socket
import sys
from pathlib import Path

import pytest

from rollout_service.engines.base import EngineUnavailableError
from rollout_service.engines.sglang.engine import SGLangEngine
from rollout_service.engines.sglang.http_client import AiohttpServer
from rollout_service.engines.sglang.launch import (
    build_launch_command,
    service_launch_command,
    start_server,
    stop_process,
)
from rollout_service.engines.sglang.server_facts import has_pushable_drafter
from rollout_service.engines.speculative import MTPSettings
from tests.support.sglang_on_fake import MTP, VERSIONS, connect, greedy, make_fake

# --- info ---


@pytest.mark.parametrize("version", VERSIONS)
async def test_info_from_model_info_server_info_and_models(version: str, checkpoint: str) -> None:
    engine = await connect(make_fake(version, checkpoint, context_length=200))
    info = engine.info
    assert (info.engine, info.model, info.model_path) == ("sglang", "tiny", checkpoint)
    assert (info.max_model_len, info.vocab_size, info.num_speculative_tokens) == (200, 64, 3)
    assert info.speculative_method == "EAGLE" and info.has_pushable_drafter


@pytest.mark.parametrize("server_info,is_pushable", [
    ({"speculative_algorithm": "EAGLE"}, True),  # the checkpoint's MTP layers
    ({"speculative_algorithm": "NEXTN", "speculative_draft_model_path": "/ckpt"}, True),
    ({"speculative_algorithm": "EAGLE", "speculative_draft_model_path": "/eagle-head"}, False),
    ({"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": "/eagle3"}, False),
    ({"speculative_algorithm": None}, False),
])
def test_pushable_drafter_is_the_checkpoints_own(server_info: dict, is_pushable: bool) -> None:
    assert has_pushable_drafter(server_info, {"/ckpt", "org/ckpt"}) == is_pushable



# --- launch command ---


def test_launch_command_carries_the_speculative_server_args() -> None:
    command = build_launch_command(
        "/ckpt", {"tp_size": 2, "enable_draft_weights_cpu_backup": True, "disable_radix_cache":
                  False, "speculative_eagle_topk": None, "cuda_graph_bs": [1, 2]},
        MTP, host="127.0.0.1", port=30123, python="python")
    assert command == [
        "python", "-m", "sglang.launch_server", "--model-path", "/ckpt", "--host", "127.0.0.1",
        "--port", "30123", "--tp-size", "2", "--enable-draft-weights-cpu-backup",
        "--cuda-graph-bs", "1", "2", "--speculative-algorithm", "EAGLE",
        "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "4"]
    tree = build_launch_command("/ckpt", {"speculative_eagle_topk": 2}, MTP, host="h", port=1)
    assert tree[tree.index("--speculative-num-draft-tokens") + 1] == "7"  # steps * topk + 1
    no_mtp = build_launch_command("/ckpt", {}, MTPSettings(enabled=False), host="h", port=1)
    assert not any(arg.startswith("--speculative") for arg in no_mtp)


def test_the_service_launches_its_server_without_a_second_access_log() -> None:
    """The service logs each client request; its server's uvicorn would log it again."""
    command = service_launch_command("/ckpt", {"tp_size": 2}, MTP, host="h", port=1)
    assert command[command.index("--log-level-http") + 1] == "warning"
    assert command[command.index("--tp-size") + 1] == "2"
    mine = service_launch_command("/ckpt", {"log_level_http": "info"}, MTP, host="h", port=1)
    assert mine[mine.index("--log-level-http") + 1] == "info"  # the user's kwargs win
    own = build_launch_command("/ckpt", {}, MTP, host="h", port=1)  # SGLang's own defaults
    assert "--log-level-http" not in own


def test_launch_command_refuses_bad_kwargs() -> None:
    with pytest.raises(ValueError, match=r"\['port'\] are set by the service"):
        build_launch_command("/ckpt", {"port": 1}, MTP, host="h", port=2)
    with pytest.raises(ValueError, match="speculative_num_draft_tokens"):
        build_launch_command("/ckpt", {"speculative_num_draft_tokens": 9}, MTP, host="h", port=2)


# --- feature detection ---


@pytest.mark.parametrize("is_openapi_enabled", [True, False])
async def test_features_by_route_and_field(is_openapi_enabled: bool, checkpoint: str) -> None:
    new = await connect(make_fake("0.5.23", checkpoint, is_openapi_enabled=is_openapi_enabled))
    old = await connect(make_fake("0.5.12", checkpoint, is_openapi_enabled=is_openapi_enabled))
    route = "/update_weights_from_tensor"
    assert new.features.has_weight_update_session and not old.features.has_weight_update_session
    assert new.features.accepts(route, "selector") and not old.features.accepts(route, "selector")
    assert old.features.accepts(route, "disable_draft_model")
    assert not new.features.accepts(route, "disable_draft_model")


@pytest.mark.parametrize(("base_gpu_id", "num_gpus", "expected"), [
    (2, 4, "cuda:2"),  # SGLang's first GPU, not this process's current one (0)
    (0, 4, "cuda:0"),
    (6, 4, "cuda:1"),  # a server on another host: this process's current GPU
    (2, 0, "cpu"),  # no CUDA here: gloo on the CPU
])
async def test_nccl_rank_receives_on_sglangs_first_gpu(
        base_gpu_id: int, num_gpus: int, expected: str, checkpoint: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: num_gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: num_gpus)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    fake = make_fake("0.5.23", checkpoint)
    fake.base_gpu_id = base_gpu_id
    engine = await connect(fake)
    assert str(engine.receive_device) == expected
    assert engine.group_backends == (("nccl", "gloo") if num_gpus else ("gloo",))


# --- health ---


async def test_health(checkpoint: str) -> None:
    fake = make_fake("0.5.23", checkpoint)
    engine = await connect(fake)
    await engine.health()
    fake.is_healthy = False
    with pytest.raises(EngineUnavailableError, match="503"):
        await engine.health()


async def test_unreachable_server(checkpoint: str) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"  # closed once the block ends
    with pytest.raises(EngineUnavailableError, match="unreachable"):
        await SGLangEngine.connect(url, served_model_name="tiny", model_path=checkpoint)
    engine = await connect(make_fake("0.5.23", checkpoint))
    engine._http = AiohttpServer(url)  # the server went away
    with pytest.raises(EngineUnavailableError, match="unreachable"):
        await engine.health()
    with pytest.raises(EngineUnavailableError, match="unreachable"):
        await engine.generate([1], greedy(1), "gone")


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None,
                    reason="sglang is installed: the launch would start a real server")
async def test_launch_reports_a_server_that_exits(checkpoint: str) -> None:
    """``python -m sglang.launch_server`` without sglang exits at once; launch says so."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(EngineUnavailableError, match="SGLang exited with code 1"):
        await SGLangEngine.launch(checkpoint, {}, MTP, served_model_name="tiny", port=port,
                                  startup_timeout_s=60)


async def test_a_started_server_keeps_the_health_polls_client(tmp_path: Path) -> None:
    """``start_server`` polls ``/health`` with the client the engine then keeps (one
    pool for the server's life): it returns once the server answers 200, the client
    still open. A static file server stands in for SGLang; ``health`` is a file there."""
    (tmp_path / "health").write_text("ok")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    http = AiohttpServer(f"http://127.0.0.1:{port}")
    command = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
               "--directory", str(tmp_path)]
    process = await start_server(command, http, startup_timeout_s=60)
    try:
        assert process.returncode is None
        assert (await http.send("GET", "/health")).body == b"ok"  # the same pool, open
    finally:
        await stop_process(process)
        await http.aclose()
    assert process.returncode is not None
