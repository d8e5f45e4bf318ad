"""The ``nccl`` transport end to end on the CPU: the trainer owns the group, broadcasts
each bucket of a push during its update call (gloo here, NCCL on CUDA: the same protocol
and code), into the real vLLM CPU engine.

One service for the module (``weights_transport: nccl``, 1 MiB buckets so that the
embedded tiny model's 4.9 MB take five and its embedding spans two); the trainer is this
test process (``WeightPusher(transport="nccl")``), or a spawned one where it must die.
Each fault case of the transport is a test: the served weights and versions stay, no
engine process dies, the group is freed, the next push loads.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from safetensors.torch import load_file

from rollout_service.client import RolloutClient, ServiceError
from rollout_service.embedded import ensure_model
from rollout_service.protocol import messages
from rollout_service.protocol.broadcast import Rendezvous
from rollout_service.tools.launch import ServiceProcess
from tests.integration.conftest import (
    API_KEY,
    TARGET,
    WEIGHTS_TOKEN,
    run_service,
    served_version,
    service_config,
    wait_for,
)
from tests.integration.conftest import weights_checksums as checksums
from tests.integration.conftest import weights_status as status
from tests.support.faulty_trainer import break_bucket, push_and_die
from tests.support.shm_usage import new_shm_files, process_tree
from trainer_client.push import WeightPusher

pytestmark = pytest.mark.skipif(TARGET.transport != "shm" or TARGET.tensor_device != "cpu",
                                reason="the CPU engine's gloo group (the CPU target only)")

GROUP_TIMEOUT_S = 30.0
"""Long enough that a busy 2-core machine holding a worker off the CPU for seconds fails
no push; the stall test asks its own group for less."""
STALL_TIMEOUT_S = 4.0
BUCKET_BYTES = 1 << 20
MAIN_PARAM = "lm_head.weight"
DRAFT_PARAM = "model.mtp_layers.0.input_proj.weight"
HEADERS = {"authorization": f"Bearer {WEIGHTS_TOKEN}"}


@pytest.fixture(scope="module")
def nccl_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    with run_service(tmp_path_factory.mktemp("nccl"), weights_transport="nccl",
                     weights_group_timeout_s=GROUP_TIMEOUT_S,
                     weights_bucket_bytes=BUCKET_BYTES) as proc:
        yield proc


@pytest.fixture(scope="module")
def original() -> dict[str, torch.Tensor]:
    return load_file(str(Path(ensure_model("tiny")) / "model.safetensors"))


@pytest.fixture
def pusher(nccl_service: ServiceProcess) -> Iterator[WeightPusher]:
    """A trainer for one test; it releases its group when the test ends."""
    with WeightPusher(nccl_service.url, WEIGHTS_TOKEN, transport="nccl",
                      bucket_bytes=BUCKET_BYTES) as p:
        yield p


def changed(original: dict[str, torch.Tensor], *names: str) -> dict[str, torch.Tensor]:
    out = dict(original)
    for name in names:
        out[name] = original[name] + 0.5
    return out


def engine_processes(service: ServiceProcess) -> set[int]:
    return {p.pid for p in psutil.Process(service.child.pid).children(recursive=True)}


def group_state(service: ServiceProcess) -> messages.WeightGroupState:
    response = httpx.get(f"{service.url}/weights/group/state", headers=HEADERS, timeout=60)
    assert response.status_code == 200, response.text
    return messages.WeightGroupState.model_validate(response.json())


async def generates(service: ServiceProcess) -> bool:
    async with RolloutClient(service.url, api_key=API_KEY) as client:
        out = await client.generate(messages.GenerateRequest(prompt_token_ids=[5, 6, 7],
                                                             max_tokens=4))
    return len(out.outputs[0].token_ids) == 4


def test_pushes_change_main_and_drafter_and_restore_bit_for_bit(
        nccl_service: ServiceProcess, pusher: WeightPusher,
        original: dict[str, torch.Tensor]) -> None:
    """Five buckets per push, through rings of two 1 MiB slots: main and drafter change,
    the original comes back bit for bit, no worker held more than its two slots, and no
    process of the push (the trainer, the service, its engine's) touched /dev/shm."""
    baseline = checksums(nccl_service)
    version = served_version(nccl_service) + 1
    in_push = [os.getpid(), *process_tree(nccl_service.child.pid)]  # trainer and service
    with new_shm_files(lambda: in_push) as shm_usage:
        report = pusher.push(changed(original, MAIN_PARAM, DRAFT_PARAM).items(),
                             version=version)
    moved = checksums(nccl_service)
    assert moved["main"] != baseline["main"] and moved["draft"] != baseline["draft"]
    assert report.num_buckets == 5 and report.server.timings.receive_s > 0
    peaks = report.server.receive_peak_bytes
    assert peaks and all(0 < peak <= 2 * BUCKET_BYTES for peak in peaks), peaks
    state = status(nccl_service)
    assert (state.main_version, state.draft_version) == (version, version)
    pusher.push(original.items(), version=version + 1)
    assert checksums(nccl_service) == baseline
    # no process of the push mapped or opened a file under /dev/shm
    assert not shm_usage.new, shm_usage.new


def test_a_refused_push_changes_nothing_and_keeps_the_group(
        nccl_service: ServiceProcess, pusher: WeightPusher,
        original: dict[str, torch.Tensor]) -> None:
    pusher.push(original.items(), version=served_version(nccl_service) + 1)  # group joined
    group_id = pusher._group.group_id  # type: ignore[union-attr]
    before, state = checksums(nccl_service), status(nccl_service)
    bad = dict(original)
    bad[MAIN_PARAM] = original[MAIN_PARAM].double()
    with pytest.raises(ServiceError, match="dtype") as info:
        pusher.push(bad.items(), version=state.newest_version + 1)
    assert info.value.status == 400
    assert checksums(nccl_service) == before
    assert status(nccl_service).main_version == state.main_version
    pusher.push(original.items(), version=state.newest_version + 1)
    assert pusher._group.group_id == group_id  # type: ignore[union-attr]


@pytest.mark.parametrize("fault,status_code,keeps_group", [
    ("stall", 408, False), ("short", 400, True), ("long", 400, False)])
async def test_a_broken_bucket_loads_nothing_and_the_next_push_works(
        nccl_service: ServiceProcess, original: dict[str, torch.Tensor], fault: str,
        status_code: int, keeps_group: bool) -> None:
    """The trainer's third bucket stalls (nothing sent until the group's timeout), comes
    short (its checksum refuses it) or long (more than a slot: every worker leaves the
    group rather than receive it): the push fails naming the bucket, nothing loads,
    generation serves on, no engine process died, the group is closed where the
    broadcast broke, and the next push (in the same group or a new one) loads."""
    engines, before, state = (engine_processes(nccl_service), checksums(nccl_service),
                              status(nccl_service))
    with WeightPusher(nccl_service.url, WEIGHTS_TOKEN, transport="nccl",
                      bucket_bytes=BUCKET_BYTES, group_timeout_s=STALL_TIMEOUT_S) as trainer:
        break_bucket(trainer, fault, index=2)
        started = time.monotonic()
        with pytest.raises(ServiceError, match="bucket 2") as info:
            trainer.push(changed(original, MAIN_PARAM).items(),
                         version=state.newest_version + 1)
        assert info.value.status == status_code, info.value
        assert time.monotonic() - started < STALL_TIMEOUT_S + 60
        after = status(nccl_service)
        assert after.consistent and after.last_push is not None
        assert after.last_push.outcome in ("failed", "rejected")
        assert (after.main_version, after.draft_version) == (state.main_version,
                                                              state.draft_version)
        assert checksums(nccl_service) == before
        assert await generates(nccl_service)
        assert (group_state(nccl_service).current is not None) == keeps_group
    assert engine_processes(nccl_service) == engines
    with WeightPusher(nccl_service.url, WEIGHTS_TOKEN, transport="nccl",
                      bucket_bytes=BUCKET_BYTES) as trainer:
        trainer.push(changed(original, MAIN_PARAM).items(), version=state.newest_version + 2)
        assert checksums(nccl_service)["main"] != before["main"]
        trainer.push(original.items(), version=state.newest_version + 3)
    assert checksums(nccl_service) == before


def test_a_trainer_that_dies_mid_broadcast_leaves_the_served_weights(
        nccl_service: ServiceProcess, original: dict[str, torch.Tensor]) -> None:
    """A trainer process that sends its third bucket's header and exits: its store and
    sockets close, every worker's receive ends at once (not at the group's timeout),
    nothing loads, the group is freed, and the next trainer pushes."""
    engines, before, state = (engine_processes(nccl_service), checksums(nccl_service),
                              status(nccl_service))
    trainer = multiprocessing.get_context("spawn").Process(target=push_and_die, args=(
        nccl_service.url, WEIGHTS_TOKEN, str(Path(ensure_model("tiny")) / "model.safetensors"),
        state.newest_version + 1, 2, BUCKET_BYTES))
    trainer.start()
    trainer.join(300)
    assert trainer.exitcode == 3
    died = time.monotonic()
    after = wait_for(lambda: status(nccl_service),
                     lambda s: s.active_push_id is None and s.last_push is not None
                     and s.last_push.version == state.newest_version + 1,
                     timeout_s=GROUP_TIMEOUT_S + 120)
    assert time.monotonic() - died < GROUP_TIMEOUT_S  # its connections closed
    assert after.last_push.outcome == "failed" and "broadcast" in after.last_push.detail
    assert after.consistent
    assert (after.main_version, after.draft_version) == (state.main_version, state.draft_version)
    assert checksums(nccl_service) == before
    assert group_state(nccl_service).current is None
    assert engine_processes(nccl_service) == engines
    with WeightPusher(nccl_service.url, WEIGHTS_TOKEN, transport="nccl",
                      bucket_bytes=BUCKET_BYTES) as pusher:
        pusher.push(changed(original, MAIN_PARAM).items(), version=state.newest_version + 2)
        assert checksums(nccl_service)["main"] != before["main"]
        pusher.push(original.items(), version=state.newest_version + 3)
    assert checksums(nccl_service) == before


def test_a_second_trainer_waits_until_the_first_releases_its_group(
        nccl_service: ServiceProcess, original: dict[str, torch.Tensor]) -> None:
    first = WeightPusher(nccl_service.url, WEIGHTS_TOKEN, transport="nccl",
                         bucket_bytes=BUCKET_BYTES)
    first.push(original.items(), version=served_version(nccl_service) + 1)
    owner = group_state(nccl_service).current
    assert owner is not None and owner.group_id == first._group.group_id  # type: ignore[union-attr]
    with WeightPusher(nccl_service.url, WEIGHTS_TOKEN, transport="nccl",
                      bucket_bytes=BUCKET_BYTES) as second:
        with pytest.raises(ServiceError, match=f"group_id: this service is in group "
                                               f"'{owner.group_id}'") as info:
            second.push(original.items(), version=served_version(nccl_service) + 1)
        assert info.value.status == 409
        first.close()  # releases its group
        second.push(original.items(), version=served_version(nccl_service) + 1)


def test_a_group_left_without_a_call_is_released_after_its_lease(
        nccl_service: ServiceProcess) -> None:
    """A trainer that made a group and vanished (it never joins): after the lease it
    asked for, the group is gone and another trainer may make one."""
    rendezvous = Rendezvous("127.0.0.1", 30.0)
    response = httpx.post(f"{nccl_service.url}/weights/group", headers=HEADERS, timeout=60,
                          json={"group_id": "vanished", "master_address": "127.0.0.1",
                                "master_port": rendezvous.port, "world_size": 2,
                                "lease_s": 2.0, "timeout_s": 2.0})
    assert response.status_code == 200, response.text
    assert group_state(nccl_service).current.group_id == "vanished"  # type: ignore[union-attr]
    wait_for(lambda: group_state(nccl_service), lambda s: s.current is None, timeout_s=60)


def test_a_group_asks_for_the_ranks_the_service_has(nccl_service: ServiceProcess) -> None:
    rendezvous = Rendezvous("127.0.0.1", 30.0)
    state = group_state(nccl_service)
    assert (state.num_ranks, state.backend) == (1, "gloo")
    response = httpx.post(f"{nccl_service.url}/weights/group", headers=HEADERS, timeout=60,
                          json={"group_id": "too-small", "master_address": "127.0.0.1",
                                "master_port": rendezvous.port, "world_size": 2,
                                "rank_offset": 2})
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("world_size: 2 cannot hold")


async def greedy(url: str) -> list[list[int]]:
    async with RolloutClient(url, api_key=API_KEY) as client:
        return [(await client.generate(messages.GenerateRequest(
            prompt_token_ids=prompt, max_tokens=8, temperature=0.0))).outputs[0].token_ids
            for prompt in ([5, 17, 42], [9, 3, 11, 30])]


async def test_a_tensor_parallel_engine_takes_the_push_on_every_rank(
        tmp_path: Path, original: dict[str, torch.Tensor]) -> None:
    """Two engine workers (tensor parallel 2 on the CPU, one OpenMP thread each) join as
    ranks 1 and 2: a push changes both shards (each rank's checksum moves) and the
    outputs they produce, and the original pushed back gives the first outputs again,
    token for token."""
    config = service_config(tmp_path, weights_transport="nccl",
                            weights_group_timeout_s=GROUP_TIMEOUT_S,
                            weights_bucket_bytes=BUCKET_BYTES,
                            engine_kwargs={**TARGET.engine_kwargs, "tensor_parallel_size": 2})
    with ServiceProcess(tmp_path / "service.log", config=config,
                        env={"VLLM_CPU_OMP_THREADS_BIND": "nobind",
                             "OMP_NUM_THREADS": "1"}) as tp2:
        tp2.wait_healthy(timeout_s=600)
        first, before = await greedy(tp2.url), checksums(tp2)
        assert {"main/rank0", "main/rank1"} <= set(before)
        noisy = dict(original)  # a uniform shift of lm_head would move no argmax
        noisy[MAIN_PARAM] = original[MAIN_PARAM] + torch.randn(
            original[MAIN_PARAM].shape, generator=torch.Generator().manual_seed(3),
            dtype=original[MAIN_PARAM].dtype)
        with WeightPusher(tp2.url, WEIGHTS_TOKEN, transport="nccl",
                          bucket_bytes=BUCKET_BYTES) as tp_pusher:
            report = tp_pusher.push(noisy.items(), version=1)
            assert len(report.server.receive_peak_bytes or ()) == 2
            moved = checksums(tp2)
            assert all(moved[f"main/rank{r}"] != before[f"main/rank{r}"] for r in (0, 1))
            changed_outputs = await greedy(tp2.url)
            assert changed_outputs != first
            tp_pusher.push(original.items(), version=2)
        assert await greedy(tp2.url) == first
        assert checksums(tp2) == before
        assert status(tp2).main_version == 2


def test_groups_are_for_the_nccl_transport_only(service: ServiceProcess) -> None:
    with httpx.Client(base_url=service.url, timeout=60, headers=HEADERS) as c:
        response = c.post("/weights/group", json={
            "group_id": "g", "master_address": "127.0.0.1", "master_port": 1,
            "world_size": 2})
    assert response.status_code == 403  # off by configuration
    assert response.json()["error"]["message"].startswith("weights_transport:")
