"""``nccl`` pushes into the SGLang engine, end to end on the CPU: the trainer owns a gloo
group, the service process joins it as the SGLang server's one rank, receives every bucket
into its ring and stored copy, and loads the main model and the drafter from that copy.

SGLang cannot serve here: the engine drives the FAKE SGLang server
(``sglang_shared_payloads.SharedPayloadFake``, a real HTTP server on loopback) that
unpickles each load's payload as SGLang's TP worker does and slices the tensors out of
it; SGLang's serializer is stood in for (it is not installed here). The trainer is
``WeightPusher(transport="nccl")`` in the test process; the service runs under uvicorn in
a thread of it. The intake, the group and the receive are the ones vLLM's workers use
(``test_broadcast_push.py``); what is SGLang's own here is the rank in the service process
(``engines/sglang/group_receiver.py``) and the load from the stored copy.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from rollout_service.api.app import create_app
from rollout_service.client import ServiceError
from rollout_service.config import ServiceConfig
from rollout_service.embedded import ensure_model
from tests.integration.rollout_service.framework_trainers import (
    SGLangTrainer,
    sglang_push_and_die,
)
from tests.support.loopback_server import serving
from tests.support.sglang_on_fake import SPEC_ARGS
from tests.support.sglang_shared_payloads import (
    SharedPayloadFake,
    stand_in_for_sglang_serializer,
)
from tests.support.waiting import wait_for
from trainer_client.push import WeightPusher

TOKEN = "weights-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
DRAFT_PARAM = "model.mtp_layers.0.input_proj.weight"


@pytest.fixture
def service(monkeypatch: pytest.MonkeyPatch, tmp_path: Path
            ) -> Iterator[tuple[SharedPayloadFake, str]]:
    """The fake SGLang server and a service with ``weights_transport: nccl`` on it."""
    stand_in_for_sglang_serializer(monkeypatch)
    fake = SharedPayloadFake("0.5.23", model_path=str(ensure_model("tiny")),
                             speculative=SPEC_ARGS)
    with serving(fake.app) as url:
        config = ServiceConfig(model=fake.model_path, engine="sglang", engine_url=url,
                               served_model_name="tiny", weights_transport="nccl",
                               weights_token=TOKEN, weights_store_dir=tmp_path / "store",
                               weights_group_timeout_s=30)
        with serving(create_app(config)) as service_url:
            yield fake, service_url


def pushed_tensors(seed: int) -> dict[str, torch.Tensor]:
    """The tiny checkpoint with the drafter's input projection drawn anew."""
    tensors = load_file(str(Path(ensure_model("tiny")) / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    tensors[DRAFT_PARAM] = torch.randn(tensors[DRAFT_PARAM].shape, generator=g).to(
        tensors[DRAFT_PARAM].dtype)
    return tensors


def push_state(url: str) -> dict:
    """``/weights/status``."""
    status = httpx.get(f"{url}/weights/status", headers=AUTH)
    status.raise_for_status()
    return status.json()


def versions(url: str) -> tuple[int | None, int | None]:
    """The main model's and the drafter's served versions."""
    state = push_state(url)
    return state["main_version"], state["draft_version"]


def test_an_nccl_push_loads_both_models_from_the_copy_the_service_received(
        service: tuple[SharedPayloadFake, str]) -> None:
    fake, url = service
    tensors = pushed_tensors(seed=1)
    with WeightPusher(url, TOKEN, transport="nccl", bucket_bytes=256 * 1024) as pusher:
        report = pusher.push(tensors.items(), version=7, target="both")
        assert report.num_buckets > 2  # several buckets through the ring of two slots
        # one load of both models (selector all): the received copy is mapped once
        assert [(load.selector, load.weight_version) for load in fake.loads] == [("all", "7")]
        for load in fake.loads:  # every tensor, bit for bit, from the received copy
            assert load.tensors.keys() == tensors.keys()
            assert all(torch.equal(load.tensors[n], t) for n, t in tensors.items())
        assert versions(url) == (7, 7)

        # A refused push (a dtype the served checkpoint does not have) loads nothing.
        bad = pushed_tensors(seed=2)
        bad[DRAFT_PARAM] = bad[DRAFT_PARAM].float()
        with pytest.raises(ServiceError, match="dtype") as refused:
            pusher.push(bad.items(), version=8, target="both")
        assert refused.value.status == 400
        assert len(fake.loads) == 1
        assert versions(url) == (7, 7)

        # The group stays the trainer's: the next push goes through it.
        drafter_only = pushed_tensors(seed=3)
        pusher.push(drafter_only.items(), version=9, target="draft")
    assert [(load.selector, load.weight_version) for load in fake.loads[1:]] == [
        ("draft", None)]
    assert torch.equal(fake.loads[1].tensors[DRAFT_PARAM], drafter_only[DRAFT_PARAM])


def test_slimes_sync_through_the_sglang_dialect_loads_sglang(
        service: tuple[SharedPayloadFake, str]) -> None:
    """slime's trainer (``framework_trainers.SGLangTrainer``: SGLang's own
    ``/init_weights_update_group`` and ``/update_weights_from_distributed`` per bucket, then
    ``/continue_generation``) syncing a service that itself fronts SGLang."""
    fake, url = service
    tensors = pushed_tensors(seed=4)
    trainer = SGLangTrainer(url, weights_token=TOKEN)
    assert trainer.init_answer.status_code == 200, trainer.init_answer.text
    answer = trainer.sync(tensors, version=11, bucket_bytes=256 * 1024)
    assert answer.status_code == 200, answer.text
    assert [(load.selector, load.weight_version) for load in fake.loads] == [("all", "11")]
    assert all(torch.equal(fake.loads[-1].tensors[n], t) for n, t in tensors.items())
    assert versions(url) == (11, 11)
    assert trainer.destroy().status_code == 200


def test_a_trainer_that_dies_mid_broadcast_loads_nothing_into_sglang(
        service: tuple[SharedPayloadFake, str]) -> None:
    """slime's trainer, a process of its own, broadcasts one tensor of a bucket and exits:
    the service's rank sees the broadcast break, SGLang loads nothing, the versions stay,
    and the next trainer's sync loads."""
    fake, url = service
    trainer = multiprocessing.get_context("spawn").Process(target=sglang_push_and_die, args=(
        url, TOKEN, "", str(Path(ensure_model("tiny")) / "model.safetensors"), 5))
    trainer.start()
    trainer.join(300)
    assert trainer.exitcode == 3
    wait_for(lambda: push_state(url), lambda state: state["active_push_id"] is None,
             timeout_s=120)
    assert push_state(url)["last_push"]["outcome"] in ("failed", "aborted", "rejected")
    assert fake.loads == [] and versions(url) == (None, None)
    assert httpx.post(f"{url}/continue_generation", json={}).status_code == 200
    # The broken broadcast ended the group: the next trainer makes its own.
    assert httpx.get(f"{url}/weights/group/state", headers=AUTH).json()["current"] is None
    tensors = pushed_tensors(seed=6)
    again = SGLangTrainer(url, weights_token=TOKEN)
    assert again.sync(tensors, version=6, bucket_bytes=256 * 1024).status_code == 200
    assert versions(url) == (6, 6)
    assert all(torch.equal(fake.loads[-1].tensors[n], t) for n, t in tensors.items())
