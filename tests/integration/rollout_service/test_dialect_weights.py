"""The frameworks' weight sync, in SGLang's and vLLM's dialects, into the real service.

One service for the module, ``weights_transport: nccl`` over gloo: on the ``cpu`` target
the vLLM CPU engine (MTP on); on the ``sglang`` target (GPU) a live SGLang server the
service launches, the service's rank receiving on the CPU (a trainer on the server's only
GPU cannot be a second NCCL rank there) and loading SGLang from its received copy. The
trainers are this test process or a spawned one, each calling the routes as its framework
does (``framework_trainers.py`` cites the upstream code): slime's and AReaL's syncs over a
torch group, vLLM's ``NCCLTrainerWeightTransferEngine`` (SkyRL) over the CPU stand-in of
PyNccl, through vLLM's own HTTP client with the weights token in the server URL (HTTP
Basic auth, as ``requests`` sends it; vLLM's, so not on the ``sglang`` target).
"""

from __future__ import annotations

import multiprocessing
import os
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import requests
import torch
from safetensors.torch import load_file

from rollout_service.embedded import ensure_model
from rollout_service.tools.launch import ServiceProcess
from tests.integration.conftest import (
    API_KEY,
    TARGET,
    TARGETS,
    WEIGHTS_TOKEN,
    run_service,
    wait_for,
)
from tests.integration.conftest import weights_checksums as checksums
from tests.integration.conftest import weights_status as status
from tests.integration.rollout_service.framework_trainers import (
    SGLangTrainer,
    VLLMTrainer,
    drafter_tensors,
    sglang_push_and_die,
)
from tests.support.shm_usage import new_shm_files, process_tree

pytestmark = pytest.mark.skipif(
    TARGET not in (TARGETS["cpu"], TARGETS["sglang"]),
    reason="a gloo group: the CPU target, or SGLang's rank (vLLM's CUDA workers join nccl)")

MAIN_PARAM = "lm_head.weight"
DRAFT_PARAMS = ("model.mtp_layers.0.input_proj.weight",)
HEADERS = {"authorization": f"Bearer {WEIGHTS_TOKEN}"}


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    with run_service(tmp_path_factory.mktemp("dialect-weights"), weights_transport="nccl",
                     weights_group_timeout_s=30.0) as proc:
        yield proc


@pytest.fixture(scope="module")
def original() -> dict[str, torch.Tensor]:
    return load_file(str(Path(ensure_model("tiny")) / "model.safetensors"))


def slime(service: ServiceProcess) -> SGLangTrainer:
    return SGLangTrainer(service.url, weights_token=WEIGHTS_TOKEN, api_key=API_KEY)


def changed(original: dict[str, torch.Tensor], *names: str) -> dict[str, torch.Tensor]:
    return {n: (t + 0.5 if n in names else t) for n, t in original.items()}


def release(service: ServiceProcess) -> None:
    state = httpx.get(f"{service.url}/weights/group/state", headers=HEADERS, timeout=60).json()
    if state["current"] is not None:
        httpx.post(f"{service.url}/weights/group/release", headers=HEADERS, timeout=60,
                   json={"group_id": state["current"]["group_id"]})


def sglang_version(service: ServiceProcess) -> str:
    return httpx.get(f"{service.url}/get_weight_version", timeout=60, headers={
        "authorization": f"Bearer {API_KEY}"}).json()["weight_version"]


def test_a_slime_sync_loads_main_and_drafter_and_restores_them(
        service: ServiceProcess, original: dict[str, torch.Tensor]) -> None:
    """slime's sync (pause, buckets with weight_version, continue) loads main and drafter
    at /continue_generation, visible in every dialect's version; the next sync restores
    the original bit for bit; on vLLM no process of the push touched /dev/shm (SGLang's
    TP workers map the copy the service received from torch's shm file)."""
    baseline = checksums(service)
    version = status(service).newest_version + 1
    trainer = slime(service)
    assert trainer.init_answer.json() == {
        "success": True, "message": "Succeeded to initialize custom process group."}
    in_push = [os.getpid(), *process_tree(service.child.pid)]  # trainer and service
    with new_shm_files(lambda: in_push) as shm_usage:
        answer = trainer.sync(changed(original, MAIN_PARAM, *DRAFT_PARAMS), version=version)
    assert answer.status_code == 200, answer.text
    moved = checksums(service)
    assert moved["main"] != baseline["main"] and moved["draft"] != baseline["draft"]
    state = status(service)
    assert (state.main_version, state.draft_version) == (version, version)
    assert sglang_version(service) == str(version)
    weight_info = httpx.get(f"{service.url}/weight_info", timeout=60, headers={
        "authorization": f"Bearer {API_KEY}"}).json()
    assert weight_info == {"weight_version": str(version)}
    out = httpx.post(f"{service.url}/generate", timeout=120,
                     headers={"authorization": f"Bearer {API_KEY}"}, json={
        "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}}).json()
    assert out["meta_info"]["weight_version"] == str(version)
    answer = trainer.sync(original, version=version + 1)
    assert answer.status_code == 200, answer.text
    assert checksums(service) == baseline
    assert trainer.destroy().json()["success"] is True
    if TARGET.engine == "vllm":  # SGLang's TP workers map the copy the service received
        assert not shm_usage.new, shm_usage.new  # from torch's shm file (sglang/payload.py)


def test_a_refused_sglang_update_loads_nothing(
        service: ServiceProcess, original: dict[str, torch.Tensor]) -> None:
    """A wrong shape, a wrong dtype and an unknown name: each refused (400, SGLang's
    answer naming the tensor) before anything loads; the served weights stay."""
    before, state = checksums(service), status(service)
    trainer = slime(service)
    name = MAIN_PARAM
    cases = [
        ([(name, original[name][:-1].clone())], "has shape|is bfloat16"),
        ([(name, original[name].half())], "float16"),
        ([("model.no_such.weight", original[name])], "not in the served model"),
    ]
    for bucket, match in cases:
        trainer.pause()
        answer = trainer.update(bucket, version=state.newest_version + 1)
        assert answer.status_code == 400, answer.text
        assert answer.json()["success"] is False
        assert re.search(match, answer.json()["message"]), answer.text
        assert trainer.resume().status_code == 200
    assert checksums(service) == before
    after = status(service)
    assert (after.main_version, after.draft_version) == (state.main_version,
                                                          state.draft_version)
    trainer.destroy()


def test_a_second_trainer_is_refused_until_the_first_lets_go(
        service: ServiceProcess) -> None:
    """While slime's group lives, vLLM's trainer's init is 409 naming the group (and an
    SGLang one too); once destroyed, another trainer joins."""
    first = slime(service)
    answer = httpx.post(f"{service.url}/init_weights_update_group", headers=HEADERS,
                        timeout=60, json={"master_address": "127.0.0.1", "master_port": "1",
                                          "rank_offset": 1, "world_size": 2,
                                          "backend": "gloo", "pp_rank": 0})
    assert answer.status_code == 409 and answer.json()["success"] is False, answer.text
    assert "update_weight_group" in answer.json()["message"]
    answer = httpx.post(f"{service.url}/init_weight_transfer_engine", headers=HEADERS,
                        timeout=60, json={"init_info": {
                            "master_address": "127.0.0.1", "master_port": 1,
                            "rank_offset": 1, "world_size": 2}})
    assert answer.status_code == 409, answer.text
    assert first.destroy().status_code == 200
    assert httpx.get(f"{service.url}/weights/group/state", headers=HEADERS,
                     timeout=60).json()["current"] is None


def test_the_dialect_weight_routes_need_the_weights_token(service: ServiceProcess) -> None:
    for path in ("/init_weights_update_group", "/init_weight_transfer_engine",
                 "/start_weight_update"):
        answer = httpx.post(f"{service.url}{path}", json={}, timeout=60)
        assert answer.status_code == 401, answer.text
        assert "http://weights:<token>@host:port" in answer.text


def test_pickled_ipc_handles_are_refused_naming_the_field(service: ServiceProcess) -> None:
    answer = httpx.post(f"{service.url}/update_weights", headers=HEADERS, timeout=60, json={
        "update_info": {"names": ["lm_head.weight"], "dtype_names": ["bfloat16"],
                        "shapes": [[1, 1]], "ipc_handles_pickled": "gASVAAAA"}})
    assert answer.status_code == 400, answer.text
    message = answer.json()["error"]["message"]
    assert "ipc_handles_pickled" in message and "nccl" in message and "cuda_ipc" in message


@pytest.mark.parametrize("packed", [True, False])
def test_a_skyrl_sync_loads_main_then_drafter(
        service: ServiceProcess, original: dict[str, torch.Tensor], packed: bool) -> None:
    """vLLM's trainer engine with SkyRL's drafter session: the main session (every
    tensor, packed in 1 MiB chunks or one broadcast each) loads the main model at its
    finish, the drafter session (MTP block, embedding, head) the drafter, at the main
    model's version; then both back to the original."""
    release(service)
    baseline, state = checksums(service), status(service)
    trainer = VLLMTrainer(service.url, weights_token=WEIGHTS_TOKEN, packed=packed)
    new = changed(original, MAIN_PARAM, *DRAFT_PARAMS)
    trainer.send_weights(new)
    after_main = checksums(service)
    version = state.newest_version + 1
    assert after_main["main"] != baseline["main"] and after_main["draft"] == baseline["draft"]
    assert (status(service).main_version, status(service).draft_version) == (
        version, state.draft_version)
    trainer.send_weights(drafter_tensors(new), draft=True)
    assert checksums(service)["draft"] != baseline["draft"]
    assert (status(service).main_version, status(service).draft_version) == (version, version)
    assert httpx.get(f"{service.url}/weight_info", timeout=60, headers={
        "authorization": f"Bearer {API_KEY}"}).json() == {"weight_version": str(version)}
    trainer.send_weights(original, weight_version=str(version + 5))
    trainer.send_weights(drafter_tensors(original), draft=True)
    assert checksums(service) == baseline
    assert (status(service).main_version, status(service).draft_version) == (
        version + 5, version + 5)
    trainer.client._post("shutdown_weight_transfer_engine")


def test_a_slime_trainer_that_dies_mid_broadcast_loads_nothing(
        service: ServiceProcess, original: dict[str, torch.Tensor]) -> None:
    """A trainer process that broadcasts one tensor of a bucket and exits: the update
    fails, nothing loads, no engine process dies, the group is freed, the next sync works."""
    release(service)
    engines = {p.pid for p in psutil.Process(service.child.pid).children(recursive=True)}
    before, state = checksums(service), status(service)
    trainer = multiprocessing.get_context("spawn").Process(target=sglang_push_and_die, args=(
        service.url, WEIGHTS_TOKEN, API_KEY,
        str(Path(ensure_model("tiny")) / "model.safetensors"),
        state.newest_version + 1))
    trainer.start()
    trainer.join(300)
    assert trainer.exitcode == 3
    wait_for(lambda: status(service), lambda s: s.active_push_id is None, timeout_s=120)
    assert requests.post(f"{service.url}/continue_generation", json={}, timeout=60,
                         headers={"authorization": f"Bearer {API_KEY}"}).status_code == 200
    assert checksums(service) == before
    assert status(service).main_version == state.main_version
    assert {p.pid for p in psutil.Process(service.child.pid).children(recursive=True)} \
        == engines
    release(service)
    again = slime(service)
    assert again.sync(original, version=state.newest_version + 2).status_code == 200
    again.destroy()
