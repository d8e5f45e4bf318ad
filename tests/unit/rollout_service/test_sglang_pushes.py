"""SGLang engine against the FAKE SGLang server (``fake_sglang``): weight pushes. SGLang
cannot serve here.

Everything below runs against the fake, in this process, over httpx's ASGI transport;
nothing here has run against a live SGLang server. A push through the service's
``WeightPushManager`` becomes, per server version, the calls SGLang takes (0.5.23's
weight-update sessions with a selector, 0.5.10-0.5.12's ``disable_draft_model``), one
payload per TP rank from one shared-memory segment; a failed load closes its session, a
drafter load the server cannot target is refused before anything is sent, and the
server's checksums move with a load (``nccl`` pushes: ``test_sglang_broadcast.py``).
Payloads come from ``PayloadRecorder`` (JSON of our own data); the real serializer's
round trip is the opt-in ``test_sglang_conformance.py``.
"""

from __future__ import annotations

import base64
import json
import os

import pytest
from prometheus_client import CollectorRegistry

from rollout_service.engines.base import NO_LOAD, WeightUpdate
from rollout_service.engines.sglang.features import ServerFeatures
from rollout_service.engines.sglang.payload import push_segment
from rollout_service.protocol import messages
from rollout_service.protocol.cuda_ipc import CudaIpcHandle
from rollout_service.protocol.placement import CudaIpcLocation, ShmLocation, TensorPlacement
from rollout_service.protocol.shm import Segment
from rollout_service.protocol.tensors import TensorMeta
from rollout_service.telemetry.weights import WeightMetrics
from rollout_service.weights.manager import WeightPushManager
from tests.support.sglang_on_fake import PayloadRecorder, connect, make_fake, sent


def placed(name: str, dtype: str, shape: tuple[int, ...], offset: int,
           segment: str = "rollout-sglang-unit") -> TensorPlacement:
    return TensorPlacement(name=name, dtype=dtype, shape=shape,
                           location=ShmLocation(segment=segment, offset=offset))


def shm_update(*tensors: TensorPlacement) -> WeightUpdate:
    return WeightUpdate(push_id="push-1", target="main", transport="shm", tensors=tensors)




# --- weight pushes ---

EXPECTED_PUSH_CALLS = {
    "0.5.23": [
        ("/pause_generation", {"mode": "retract"}),
        ("/begin_weight_update", {"selector": "all"}),
        ("/update_weights_from_tensor", {"selector": "all", "weight_version": "7"}),
        ("/end_weight_update", {}),
        ("/flush_cache", None),
        ("/continue_generation", {}),
    ],
    "0.5.10": [
        ("/pause_generation", {"mode": "retract"}),
        # its draft path loads the drafter and then the target
        ("/update_weights_from_tensor", {"disable_draft_model": False, "weight_version": "7"}),
        ("/flush_cache", None),
        ("/continue_generation", {}),
    ],
}


@pytest.mark.parametrize("version", sorted(EXPECTED_PUSH_CALLS))
async def test_weight_push_through_the_push_manager(version: str, checkpoint: str) -> None:
    fake = make_fake(version, checkpoint, tp_size=2)
    payloads = PayloadRecorder()
    engine = await connect(fake, payload_builder=payloads)
    tensors = {"model.embed_tokens.weight": TensorMeta(shape=(64, 8), dtype="bfloat16"),
               "model.mtp_layers.0.input_proj.weight": TensorMeta(shape=(8, 16), dtype="float32")}
    manager = WeightPushManager(engine, tensors, WeightMetrics(
        registry=CollectorRegistry(), model="tiny", engine="sglang"), timeout_s=30, has_draft=True)
    offsets = {"model.embed_tokens.weight": 0, "model.mtp_layers.0.input_proj.weight": 1024}
    name = f"rollout-sglang-test-{os.getpid()}-{version}"
    with Segment.create(name, 2048):
        begin = await manager.begin(messages.PushBeginRequest(
            version=7, target="both", segment=name, segment_bytes=2048, total_bytes=1536,
            params=[messages.ParamSpec(name=n, shape=list(m.shape), dtype=m.dtype)
                    for n, m in tensors.items()]))
        await manager.update(messages.PushUpdateRequest(push_id=begin.push_id, tensors=[
            placed(n, m.dtype, m.shape, offsets[n], segment=name) for n, m in tensors.items()]))
        fake.calls.clear()
        await manager.finish(messages.PushFinishRequest(push_id=begin.push_id))
    expected = EXPECTED_PUSH_CALLS[version]
    assert fake.routes_called() == [route for route, _ in expected]
    for (route, body), (_, want) in zip(fake.calls, expected):
        assert body == want or {key: body[key] for key in want or ()} == want, route
    update = payloads.calls[0][0]
    # Built once, for one load of both models (an shm build copies the whole segment).
    assert [num_ranks for _, num_ranks in payloads.calls] == [2]
    assert sorted((p.name, p.dtype, p.shape, p.location.offset) for p in update.tensors) == [
        ("model.embed_tokens.weight", "bfloat16", (64, 8), 0),
        ("model.mtp_layers.0.input_proj.weight", "float32", (8, 16), 1024)]
    for body in sent(fake, "/update_weights_from_tensor"):
        assert (body["load_format"], body["flush_cache"]) == ("flattened_bucket", False)
        assert [json.loads(p)["segment"] for p in body["serialized_named_tensors"]] == [name] * 2
    assert manager.status().main_version == 7 and manager.status().consistent
    assert fake.weight_version == "7"


async def test_a_push_of_both_loads_them_in_one_pass(checkpoint: str) -> None:
    """A ``target: both`` push is built and sent once, for both models (``selector: all``),
    timed as the main model's load; a drafter-only push loads the drafter alone and
    leaves the served version's label to the main model."""
    fake = make_fake("0.5.23", checkpoint)
    payloads = PayloadRecorder()
    engine = await connect(fake, payload_builder=payloads)
    tensor = placed("w", "float32", (2,), 0)
    fake.calls.clear()
    both = WeightUpdate(push_id="both-1", target="both", transport="shm", tensors=(tensor,))
    loads = await engine.load_weights(both, version="1")
    assert [u.push_id for u, _ in payloads.calls] == ["both-1"]
    loaded = sent(fake, "/update_weights_from_tensor")
    assert [(b["selector"], b["weight_version"]) for b in loaded] == [("all", "1")]
    assert loads.main.load_s > 0 and loads.draft == NO_LOAD
    fake.calls.clear()
    draft_only = WeightUpdate(push_id="draft-2", target="draft", transport="shm", tensors=(tensor,))
    loads = await engine.load_weights(draft_only, version="2")
    loaded = sent(fake, "/update_weights_from_tensor")
    assert [(b["selector"], b["weight_version"]) for b in loaded] == [("draft", None)]
    assert loads.draft.load_s > 0 and loads.main == NO_LOAD
    assert fake.weight_version == "1"


async def test_failed_load_closes_the_session(checkpoint: str) -> None:
    fake = make_fake("0.5.23", checkpoint, tp_size=2)
    engine = await connect(fake)
    engine._num_tp_ranks = 1  # one payload for two TP ranks: the fake refuses
    update = shm_update(placed("w", "float32", (2,), 0))
    with pytest.raises(RuntimeError, match="one payload per TP rank"):
        await engine.load_weights(update, version="1")
    assert fake.routes_called()[-1] == "/end_weight_update"


async def test_drafter_load_needs_a_target_field(checkpoint: str) -> None:
    """A server whose tensor route has neither selector nor disable_draft_model loads
    the main model only; a drafter load is refused before anything is sent."""
    fake = make_fake("0.5.10", checkpoint)
    engine = await connect(fake)
    route = "/update_weights_from_tensor"
    engine.features = ServerFeatures(routes=engine.features.routes, fields={
        route: engine.features.fields[route] - {"disable_draft_model"}})
    update = shm_update(placed("w", "float32", (2,), 0))
    await engine.load_weights(update, version="3")
    assert "disable_draft_model" not in sent(fake, route)[0]
    fake.calls.clear()
    draft_only = WeightUpdate(push_id="push-2", target="draft", transport="shm",
                              tensors=update.tensors)
    with pytest.raises(NotImplementedError, match="cannot target the drafter"):
        await engine.load_weights(draft_only, version="4")
    assert fake.calls == []


def test_a_push_to_sglang_lies_in_one_segment() -> None:
    assert push_segment(shm_update(placed("a", "float32", (2,), 0, segment="seg-1"),
                                   placed("b", "float32", (2,), 64, segment="seg-1"))) == "seg-1"
    with pytest.raises(ValueError, match=r"segments \['seg-1', 'seg-2'\]"):
        push_segment(shm_update(placed("a", "float32", (2,), 0, segment="seg-1"),
                                placed("b", "float32", (2,), 64, segment="seg-2")))
    with pytest.raises(ValueError, match="no tensors"):
        push_segment(shm_update())
    handle = CudaIpcHandle(
        gpu_uuid="GPU-0", shape=[2], stride=[1], storage_offset=0, dtype="float32",
        storage_handle=base64.b64encode(bytes(64)).decode(), storage_size_bytes=8,
        storage_offset_bytes=0, ref_counter_handle=base64.b64encode(b"/torch_1_2_0").decode(),
        ref_counter_offset=0, event_handle=base64.b64encode(bytes(64)).decode(),
        event_sync_required=False)
    on_gpu = TensorPlacement(name="c", dtype="float32", shape=(2,),
                             location=CudaIpcLocation(handle=handle))
    with pytest.raises(ValueError, match="'c' travels by 'cuda_ipc'"):
        push_segment(shm_update(placed("a", "float32", (2,), 0), on_gpu))


async def test_weight_checksums(checkpoint: str) -> None:
    fake = make_fake("0.5.23", checkpoint)
    engine = await connect(fake)
    before = await engine.weight_checksums()
    assert set(before) == {"main", "draft"}
    await engine.load_weights(shm_update(placed("w", "float32", (2,), 0)), version="2")
    after = await engine.weight_checksums()
    assert after["main"] != before["main"] and after["draft"] == before["draft"]
    assert sent(fake, "/weights_checker")[0] == {"action": "checksum", "selector": "target"}
    assert await (await connect(make_fake("0.5.10", checkpoint))).weight_checksums() == {}
