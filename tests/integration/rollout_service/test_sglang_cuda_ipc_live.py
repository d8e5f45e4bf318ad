"""``cuda_ipc`` pushes into a live SGLang 0.5.23 server (GPU only:
``ROLLOUT_TEST_TARGET=sglang``, the sglang bundle), checked against SGLang's own weight
checker.

The module starts its own SGLang server (the embedded tiny MiMo checkpoint, its MTP layer
as an EAGLE drafter, no radix cache) and a service with ``weights_transport: cuda_ipc``
driving it through ``engine_url``. This test process plays the trainer on the same GPU:
its tensors are on ``cuda:0`` and ``WeightPusher`` shares them as CUDA IPC handles,
staged in one buffer or each exported in place; SGLang's worker opens them
(``engines/sglang/cuda_ipc_payload.py``). Greedy answers are compared between requests
SGLang computes alike (one at a time, prefilled in full), as in ``test_sglang_live.py``.
"""

from __future__ import annotations

import base64
import gc
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bench.sglang_server import own_checksums
from rollout_service.client import RolloutClient
from rollout_service.embedded import ensure_model
from rollout_service.protocol.cuda_ipc import CudaIpcHandle, export_handle
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
from tests.support.waiting import until
from trainer_client import placing
from trainer_client.push import WeightPusher

pytestmark = LIVE_SGLANG


@pytest.fixture(scope="module")
def sglang(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The module's own SGLang server; yields its URL."""
    with own_sglang(tmp_path_factory.mktemp("sglang-ipc") / "sglang.log") as url:
        yield url


@pytest.fixture(scope="module")
def live(sglang: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    """A service taking ``cuda_ipc`` pushes into the module's server."""
    with service_on(sglang, tmp_path_factory.mktemp("ipc-service"),
                    weights_transport="cuda_ipc") as proc:
        yield proc


@pytest.fixture
async def client(live: ServiceProcess) -> AsyncIterator[RolloutClient]:
    async with RolloutClient(live.url, api_key=API_KEY) as c:
        yield c


@pytest.fixture(scope="module")
def original() -> dict[str, torch.Tensor]:
    """The checkpoint on the trainer's GPU."""
    return load_file(str(Path(ensure_model("tiny")) / "model.safetensors"), device="cuda:0")


@dataclass(frozen=True)
class Pushing:
    pusher: WeightPusher
    is_staged: bool
    """Copied into one staging buffer the pusher keeps, or each tensor exported in place."""


@pytest.fixture(params=[True, False], ids=["staged", "in-place"])
def pushing(request: pytest.FixtureRequest, live: ServiceProcess,
            original: dict[str, torch.Tensor]) -> Iterator[Pushing]:
    """A ``cuda_ipc`` pusher; afterwards the checkpoint is served again, bit for bit."""
    baseline = weights_checksums(live)
    with WeightPusher(live.url, WEIGHTS_TOKEN, transport="cuda_ipc",
                      cuda_ipc_staging=request.param) as p:
        yield Pushing(pusher=p, is_staged=request.param)
        p.push(original.items(), version=served_version(live) + 1, target="both")
    assert weights_checksums(live) == baseline


def ipc_counters(handles: list[CudaIpcHandle]) -> dict[str, int]:
    """How many exports' torch IPC reference counters hold each value now: 1 is an export
    no receiver has let go of, 0 one the trainer frees as soon as it lets go, and below 0
    one opened more than once, which torch (reading the counter unsigned) never frees.

    torch keeps each counter in a shared-memory file (``RefcountedMapAllocator``: a
    64-byte header, then int64 slots, ``ref_counter_offset`` the slot); ``gone``: the
    file was unlinked, every export in it freed.
    """
    values: list[str] = []
    for handle in handles:
        path = Path("/dev/shm") / base64.b64decode(handle.ref_counter_handle).decode().lstrip("/")
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            values.append("gone")
            continue
        at = 64 + 8 * handle.ref_counter_offset
        values.append(str(int.from_bytes(raw[at:at + 8], "little", signed=True)))
    return dict(Counter(values))


async def test_a_push_of_main_and_drafter_moves_both(
        sglang: str, live: ServiceProcess, client: RolloutClient, pushing: Pushing,
        original: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch) -> None:
    """Both models load from the trainer's GPU memory: SGLang's own checksums move in
    both, greedy outputs change, the noisy drafter is accepted less; the trainer's memory
    is all freed once the push returns (nothing left in torch's IPC limbo)."""
    before_outputs, before = await one_by_one(client), own_checksums(sglang)
    version = served_version(live) + 1
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    tensors = changed(original, seed=version)
    pushed = [weakref.ref(t) for t in tensors.values()]
    exports: list[CudaIpcHandle] = []  # in place: each tensor's own, recorded for the report

    def recorded_export(tensor: torch.Tensor, name: str) -> CudaIpcHandle:
        exports.append(export_handle(tensor, name))
        return exports[-1]

    monkeypatch.setattr(placing, "export_handle", recorded_export)
    report = pushing.pusher.push(tensors.items(), version=version, target="both")
    del tensors
    # the staged pusher keeps its buffer (64-byte aligned tensors) for the next push
    staging = report.num_bytes + 64 * report.num_tensors if pushing.is_staged else 0

    async def trainer_memory() -> int:
        """What the trainer holds once torch has freed every export SGLang let go of (a
        request between probes lets SGLang's scheduler run, should it drop the tensors it
        rebuilt only later). An export opened twice, once per model, stayed held for good
        (an H100: the whole checkpoint per push, every counter at -1)."""
        gc.collect()
        torch.cuda.ipc_collect()
        held = torch.cuda.memory_allocated()
        if held > allocated + staging + 1024**2:
            await one_by_one(client)
        return held

    try:
        await until(trainer_memory, lambda held: held <= allocated + staging + 1024**2,
                    timeout_s=60.0, interval_s=1.0)
    except TimeoutError:
        held = torch.cuda.memory_allocated() - allocated - staging
        alive = sum(ref() is not None for ref in pushed)
        counters = ipc_counters(exports)
        pushing.pusher.push(changed(original, seed=version + 1).items(), version=version + 1,
                            target="both")
        gc.collect()
        torch.cuda.ipc_collect()
        pytest.fail(f"the trainer still holds {held} bytes 60 s after a push of "
                    f"{report.num_bytes}, and {torch.cuda.memory_allocated() - allocated - staging}"
                    " after one more push (twice as many: each push's exports stay mapped; as "
                    "many: SGLang lets go of one push at the next). Of the first push's "
                    f"{len(pushed)} tensors {alive} were still referenced in the trainer; its "
                    f"{len(exports)} in-place exports' IPC counters (value: exports) were "
                    f"{counters}")
    after = own_checksums(sglang)
    assert after["target"][MAIN_ONLY_PARAM] != before["target"][MAIN_ONLY_PARAM]
    assert after["draft"] != before["draft"]
    outs = await one_by_one(client)
    assert [o.token_ids for o in outs] != [o.token_ids for o in before_outputs]
    assert accept_rate(outs) < accept_rate(before_outputs) - 0.2
    state = weights_status(live)
    assert (state.main_version, state.draft_version) == (version, version)
    # both models in the main load's requests (selector all: one open per export)
    assert report.server.timings.load_main_s > 0 and report.server.timings.load_draft_s == 0


def test_a_refused_push_changes_nothing(sglang: str, live: ServiceProcess,
                                        original: dict[str, torch.Tensor]) -> None:
    with WeightPusher(live.url, WEIGHTS_TOKEN, transport="cuda_ipc") as p:
        refuse_a_float32_push(sglang, live, p, original, MAIN_ONLY_PARAM)
