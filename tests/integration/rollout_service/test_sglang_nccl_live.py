"""``nccl`` pushes into a live SGLang 0.5.23 server from a trainer on another GPU (two
GPUs: NCCL puts no two ranks of one group on one GPU; ``ROLLOUT_TEST_TARGET=sglang``, the
sglang bundle), checked against SGLang's own weight checker.

The module starts its own SGLang server (the embedded tiny MiMo checkpoint, its MTP layer
as an EAGLE drafter, on GPU 0) and a service with ``weights_transport: nccl`` driving it
through ``engine_url``. The service process is the server's one rank
(``engines/sglang/group_receiver.py``): it sees CUDA, so its group is NCCL on SGLang's
first GPU. This test process is the trainer on GPU 1: ``WeightPusher(transport="nccl")``
owns the group and broadcasts each bucket from ``cuda:1``; the service checks and stores
every bucket and loads both models into SGLang from that copy at the finish. The CPU runs
the same path over gloo against the fake server (``test_sglang_broadcast.py``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bench.sglang_server import own_checksums
from rollout_service.client import RolloutClient
from rollout_service.embedded import ensure_model
from rollout_service.tools.launch import ServiceProcess
from tests.integration.conftest import (
    API_KEY,
    WEIGHTS_TOKEN,
    served_version,
    weights_checksums,
    weights_status,
)
from tests.integration.rollout_service.sglang_live import (
    LIVE_SGLANG,
    MAIN_ONLY_PARAM,
    accept_rate,
    changed,
    one_by_one,
    own_sglang,
    refuse_a_float32_push,
    service_on,
)
from trainer_client.push import WeightPusher

pytestmark = [*LIVE_SGLANG, pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="needs two GPUs: the trainer's NCCL rank cannot share SGLang's GPU")]

TRAINER_GPU = 1


@dataclass(frozen=True)
class Live:
    """What a test reaches: the server, the service on it, and a client of the service."""

    sglang: str
    """The module's own SGLang server (GPU 0)."""
    service: ServiceProcess
    """A service taking ``nccl`` pushes into it."""
    client: RolloutClient


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, ServiceProcess]]:
    """The module's own SGLang server on GPU 0 and a ``nccl`` service on it: their URL and
    process."""
    with own_sglang(tmp_path_factory.mktemp("sglang-nccl") / "sglang.log",
                    base_gpu_id=0) as url, service_on(
            url, tmp_path_factory.mktemp("nccl-service"), weights_transport="nccl") as proc:
        yield url, proc


@pytest.fixture
async def live(served: tuple[str, ServiceProcess]) -> AsyncIterator[Live]:
    async with RolloutClient(served[1].url, api_key=API_KEY) as client:
        yield Live(sglang=served[0], service=served[1], client=client)


@pytest.fixture(scope="module")
def original() -> dict[str, torch.Tensor]:
    """The checkpoint on the trainer's GPU, which is also this process's current one (where
    the pusher puts its bucket buffers)."""
    torch.cuda.set_device(TRAINER_GPU)
    return load_file(str(Path(ensure_model("tiny")) / "model.safetensors"),
                     device=f"cuda:{TRAINER_GPU}")


@pytest.fixture(scope="module")
def pusher(served: tuple[str, ServiceProcess], original: dict[str, torch.Tensor]
           ) -> Iterator[WeightPusher]:
    """One trainer group for the module (as a trainer keeps it from step to step);
    afterwards the checkpoint is served again, bit for bit."""
    service = served[1]
    baseline = weights_checksums(service)
    with WeightPusher(service.url, WEIGHTS_TOKEN, transport="nccl") as p:
        yield p
        p.push(original.items(), version=served_version(service) + 1, target="both")
    assert weights_checksums(service) == baseline


async def test_a_push_of_main_and_drafter_moves_both(
        live: Live, pusher: WeightPusher, original: dict[str, torch.Tensor]) -> None:
    """Both models load from the broadcast: SGLang's own checksums move in both, greedy
    outputs change, the noisy drafter is accepted less, both versions move."""
    before_outputs, before = await one_by_one(live.client), own_checksums(live.sglang)
    version = served_version(live.service) + 1
    report = pusher.push(changed(original, seed=version).items(), version=version,
                         target="both")
    after = own_checksums(live.sglang)
    assert after["target"][MAIN_ONLY_PARAM] != before["target"][MAIN_ONLY_PARAM]
    assert after["draft"] != before["draft"]
    outs = await one_by_one(live.client)
    assert [o.token_ids for o in outs] != [o.token_ids for o in before_outputs]
    assert accept_rate(outs) < accept_rate(before_outputs) - 0.2
    state = weights_status(live.service)
    assert (state.main_version, state.draft_version) == (version, version)
    assert report.num_bytes > 0 and report.server.timings.total_s > 0


def test_a_refused_push_changes_nothing_and_the_group_serves_the_next(
        served: tuple[str, ServiceProcess], pusher: WeightPusher,
        original: dict[str, torch.Tensor]) -> None:
    """A dtype the service refuses: 400 naming it, SGLang's checksums and both versions as
    they were; the trainer's next push over the same transport loads."""
    sglang, live = served
    before = own_checksums(sglang)
    refuse_a_float32_push(sglang, live, pusher, original, MAIN_ONLY_PARAM)
    version = served_version(live) + 1
    pusher.push(changed(original, seed=version).items(), version=version, target="both")
    assert own_checksums(sglang)["draft"] != before["draft"]
