"""The ``nccl`` transport end to end on the CPU: the trainer broadcasts each push to the
engine's workers in a collective group (gloo here, NCCL on CUDA: the same protocol and
code), into the real vLLM CPU engine.

A service of its own (``weights_transport: nccl``, a short group timeout), the embedded
tiny model; the trainer is this test process (``WeightPusher(transport="nccl")``).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from rollout_service.client import RolloutClient, ServiceError
from rollout_service.embedded import ensure_model
from rollout_service.protocol import messages
from rollout_service.protocol.placement import BroadcastLocation, TensorPlacement
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
from trainer_client.group import TrainerGroup
from trainer_client.push import WeightPusher, layout, param_spec, spec_nbytes

pytestmark = pytest.mark.skipif(TARGET.transport != "shm" or TARGET.tensor_device != "cpu",
                                reason="the CPU engine's gloo group (the CPU target only)")

GROUP_TIMEOUT_S = 30.0
"""Short enough for the test that waits it out, long enough that a busy 2-core machine
holding a worker off the CPU for seconds fails no push (a 10 s timeout did, once in five
runs of the tensor-parallel test beside a clean-clone test run)."""
MAIN_PARAM = "lm_head.weight"
DRAFT_PARAM = "model.mtp_layers.0.input_proj.weight"


@pytest.fixture(scope="module")
def nccl_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    with run_service(tmp_path_factory.mktemp("nccl"), weights_transport="nccl",
                     weights_group_timeout_s=GROUP_TIMEOUT_S) as proc:
        yield proc


@pytest.fixture(scope="module")
def original() -> dict[str, torch.Tensor]:
    return load_file(str(Path(ensure_model("tiny")) / "model.safetensors"))


@pytest.fixture(scope="module")
def pusher(nccl_service: ServiceProcess) -> Iterator[WeightPusher]:
    with WeightPusher(nccl_service.url, WEIGHTS_TOKEN, transport="nccl") as p:
        yield p


def changed(original: dict[str, torch.Tensor], *names: str) -> dict[str, torch.Tensor]:
    out = dict(original)
    for name in names:
        out[name] = original[name] + 0.5
    return out


def test_pushes_change_main_and_drafter_and_restore_bit_for_bit(
        nccl_service: ServiceProcess, pusher: WeightPusher,
        original: dict[str, torch.Tensor]) -> None:
    baseline = checksums(nccl_service)
    version = served_version(nccl_service) + 1
    report = pusher.push(changed(original, MAIN_PARAM, DRAFT_PARAM).items(), version=version)
    moved = checksums(nccl_service)
    assert moved["main"] != baseline["main"] and moved["draft"] != baseline["draft"]
    assert report.server.timings.receive_s > 0  # received before the pause
    state = status(nccl_service)
    assert (state.main_version, state.draft_version) == (version, version)
    pusher.push(original.items(), version=version + 1)
    assert checksums(nccl_service) == baseline


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
    # Refused at begin, before any broadcast: the group serves the next push.
    pusher.push(original.items(), version=state.newest_version + 1)
    assert pusher._group.group_id == group_id  # type: ignore[union-attr]


async def test_a_trainer_that_never_broadcasts_fails_its_push_and_nothing_loads(
        nccl_service: ServiceProcess, pusher: WeightPusher,
        original: dict[str, torch.Tensor]) -> None:
    """The trainer announces everything, asks to finish and dies before sending a byte:
    the workers' receive ends at the group's timeout, the push fails (408) with nothing
    loaded, generation goes on, and the trainer's next push gets a new group."""
    pusher.push(original.items(), version=served_version(nccl_service) + 1)  # group joined
    group_id = pusher._group.group_id  # type: ignore[union-attr]
    before, state = checksums(nccl_service), status(nccl_service)
    specs = [param_spec(n, t) for n, t in original.items()]
    sizes = [spec_nbytes(s) for s in specs]
    offsets, nbytes = layout(sizes)
    headers = {"authorization": f"Bearer {WEIGHTS_TOKEN}"}
    with httpx.Client(base_url=nccl_service.url, headers=headers,
                      timeout=GROUP_TIMEOUT_S + 120) as c:
        begin = c.post("/weights/begin", json=messages.PushBeginRequest(
            version=state.newest_version + 1, transport="nccl", group_id=group_id,
            broadcast_bytes=nbytes, total_bytes=sum(sizes), params=specs,
        ).model_dump(mode="json", exclude_none=True))
        assert begin.status_code == 200, begin.text
        push_id = begin.json()["push_id"]
        tensors = [TensorPlacement(name=s.name, dtype=s.dtype, shape=tuple(s.shape),
                                   location=BroadcastLocation(offset=o)).model_dump(mode="json")
                   for s, o in zip(specs, offsets, strict=True)]
        assert c.post("/weights/update", json={"push_id": push_id,
                                               "tensors": tensors}).status_code == 200
        started = time.monotonic()
        finish = c.post("/weights/finish", json={"push_id": push_id})
    assert finish.status_code == 408, finish.text
    assert time.monotonic() - started < GROUP_TIMEOUT_S + 60
    assert "nothing was loaded" in finish.json()["error"]["message"]
    after = status(nccl_service)
    assert after.consistent and after.last_push.outcome == "failed"
    assert (after.main_version, after.draft_version) == (state.main_version, state.draft_version)
    assert checksums(nccl_service) == before
    async with RolloutClient(nccl_service.url, api_key=API_KEY) as client:
        out = await client.generate(messages.GenerateRequest(prompt_token_ids=[5, 6, 7],
                                                             max_tokens=4))
    assert len(out.outputs[0].token_ids) == 4
    # The service closed the group; the pusher makes a new one and its push loads.
    pusher.push(changed(original, MAIN_PARAM).items(), version=state.newest_version + 2)
    assert pusher._group.group_id != group_id  # type: ignore[union-attr]
    assert checksums(nccl_service)["main"] != before["main"]
    pusher.push(original.items(), version=state.newest_version + 3)
    assert checksums(nccl_service) == before


def _trainer_killed_in_finish(url: str, version: int) -> None:
    """A trainer process (spawned) that joins a group, announces a push, sends its finish
    and dies before broadcasting a byte: its sockets, the group's included, close."""
    tensors = load_file(str(Path(ensure_model("tiny")) / "model.safetensors"))
    specs = [param_spec(n, t) for n, t in tensors.items()]
    sizes = [spec_nbytes(s) for s in specs]
    offsets, nbytes = layout(sizes)
    headers = {"authorization": f"Bearer {WEIGHTS_TOKEN}"}
    with httpx.Client(base_url=url, headers=headers, timeout=120) as c:
        group = TrainerGroup(lambda: messages.WeightGroupResponse.model_validate(
            c.post("/weights/group").json()))
        begin = c.post("/weights/begin", json=messages.PushBeginRequest(
            version=version, transport="nccl", group_id=group.group_id,
            broadcast_bytes=nbytes, total_bytes=sum(sizes), params=specs,
        ).model_dump(mode="json", exclude_none=True)).json()
        c.post("/weights/update", json={"push_id": begin["push_id"], "tensors": [
            TensorPlacement(name=s.name, dtype=s.dtype, shape=tuple(s.shape),
                            location=BroadcastLocation(offset=o)).model_dump(mode="json")
            for s, o in zip(specs, offsets, strict=True)]}).raise_for_status()
    # The whole finish request reaches the service's socket; then this process is gone.
    body = json.dumps({"push_id": begin["push_id"]}).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as raw:
        raw.sendall(b"POST /weights/finish HTTP/1.1\r\nHost: " + host.encode()
                    + b"\r\nAuthorization: Bearer " + WEIGHTS_TOKEN.encode()
                    + b"\r\nContent-Type: application/json\r\nContent-Length: "
                    + str(len(body)).encode() + b"\r\n\r\n" + body)
        os._exit(3)


def test_a_trainer_killed_in_finish_leaves_the_served_weights_and_no_waiting_rank(
        nccl_service: ServiceProcess, pusher: WeightPusher,
        original: dict[str, torch.Tensor]) -> None:
    """The trainer process dies between its finish and its broadcast: the workers'
    receive ends (the group's connections closed), the push fails with nothing loaded,
    and the next trainer pushes in a new group."""
    before, state = checksums(nccl_service), status(nccl_service)
    trainer = multiprocessing.get_context("spawn").Process(
        target=_trainer_killed_in_finish, args=(nccl_service.url, state.newest_version + 1))
    trainer.start()
    trainer.join(300)
    assert trainer.exitcode == 3
    died = time.monotonic()
    after = wait_for(lambda: status(nccl_service),
                     lambda s: s.active_push_id is None and s.last_push is not None
                     and s.last_push.version == state.newest_version + 1,
                     timeout_s=GROUP_TIMEOUT_S + 120)
    # Its connections closed: the workers stop at once, not at the group's timeout.
    assert time.monotonic() - died < GROUP_TIMEOUT_S
    assert after.last_push.outcome == "failed" and "broadcast" in after.last_push.detail
    assert after.consistent
    assert (after.main_version, after.draft_version) == (state.main_version, state.draft_version)
    assert checksums(nccl_service) == before
    pusher.push(changed(original, MAIN_PARAM).items(), version=state.newest_version + 2)
    assert checksums(nccl_service)["main"] != before["main"]
    pusher.push(original.items(), version=state.newest_version + 3)
    assert checksums(nccl_service) == before


async def greedy(url: str) -> list[list[int]]:
    async with RolloutClient(url, api_key=API_KEY) as client:
        return [(await client.generate(messages.GenerateRequest(
            prompt_token_ids=prompt, max_tokens=8, temperature=0.0))).outputs[0].token_ids
            for prompt in ([5, 17, 42], [9, 3, 11, 30])]


async def test_a_tensor_parallel_engine_takes_the_push_on_every_rank(
        tmp_path: Path, original: dict[str, torch.Tensor]) -> None:
    """Two engine workers (tensor parallel 2 on the CPU, one OpenMP thread each) join as
    ranks 1 and 2: a push changes the outputs both shards produce, and the original
    pushed back gives the first outputs again, token for token.

    On a loaded 2-core machine a broadcast used to stall with every side queued: the
    service's asks kept both workers busy-waiting and the trainer never got the CPU to
    send (docs/what-ran-where.md; fixed in 7a2c9bc, the service now waits in its store).
    A stalled push ends as any failed broadcast does, 408 with nothing loaded and the
    group closed, and the next push makes a new group; until clean-clone runs have shown
    no stall for a while, such an attempt is checked for exactly that and repeated, three
    attempts per push at most (:func:`_push_past_gloo_stalls`).
    """
    config = service_config(tmp_path, weights_transport="nccl",
                            weights_group_timeout_s=GROUP_TIMEOUT_S,
                            engine_kwargs={**TARGET.engine_kwargs, "tensor_parallel_size": 2})
    with ServiceProcess(tmp_path / "service.log", config=config,
                        env={"VLLM_CPU_OMP_THREADS_BIND": "nobind",
                             "OMP_NUM_THREADS": "1"}) as tp2:
        tp2.wait_healthy(timeout_s=600)
        first = await greedy(tp2.url)
        noisy = dict(original)  # a uniform shift of lm_head would move no argmax
        noisy[MAIN_PARAM] = original[MAIN_PARAM] + torch.randn(
            original[MAIN_PARAM].shape, generator=torch.Generator().manual_seed(3),
            dtype=original[MAIN_PARAM].dtype)
        with WeightPusher(tp2.url, WEIGHTS_TOKEN, transport="nccl") as tp_pusher:
            await _push_past_gloo_stalls(tp2, tp_pusher, noisy, version=1, outputs=first)
            changed_outputs = await greedy(tp2.url)
            assert changed_outputs != first
            await _push_past_gloo_stalls(tp2, tp_pusher, original, version=2,
                                         outputs=changed_outputs)
        assert await greedy(tp2.url) == first
        assert status(tp2).main_version == 2


async def _push_past_gloo_stalls(service: ServiceProcess, pusher: WeightPusher,
                                 tensors: dict[str, torch.Tensor], *, version: int,
                                 outputs: list[list[int]]) -> None:
    """Push ``tensors`` as ``version``; an attempt that fails in the broadcast must have
    loaded nothing (the served version and the greedy ``outputs`` as before) and is
    repeated in a new group, three attempts at most."""
    served = status(service).main_version
    failures: list[str] = []
    for _ in range(3):
        try:
            pusher.push(tensors.items(), version=version)
            return
        except ServiceError as exc:
            if exc.status != 408 or not exc.message.startswith("broadcast:"):
                raise
            failures.append(str(exc))
        assert status(service).main_version == served
        assert await greedy(service.url) == outputs  # nothing loaded
    pytest.fail("every attempt stalled in the broadcast:\n" + "\n".join(failures))


def test_groups_are_for_the_nccl_transport_only(service: ServiceProcess) -> None:
    with httpx.Client(base_url=service.url, timeout=60,
                      headers={"authorization": f"Bearer {WEIGHTS_TOKEN}"}) as c:
        response = c.post("/weights/group")
    assert response.status_code == 403  # off by configuration
    assert response.json()["error"]["message"].startswith("weights_transport:")
