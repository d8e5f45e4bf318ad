"""The dialects' weight sync as the service's pushes: the translations and the core's
per-update announcements, without an engine."""

from __future__ import annotations

import base64
import pickle
from pathlib import Path

import pytest
from starlette.requests import Request

from rollout_service.api.dialects import weight_stream
from rollout_service.api.dialects.vllm import weights_protocol as vllm_wire
from rollout_service.api.dialects.vllm.weights_serving import group_id
from rollout_service.api.dialects.weights_auth import dialect_weights_guard
from rollout_service.api.errors import Forbidden, Unauthorized
from rollout_service.protocol import messages
from rollout_service.protocol.placement import BroadcastLocation, TensorPlacement
from rollout_service.protocol.tensors import TensorMeta
from rollout_service.protocol.vllm_rendezvous import unique_id_bytes
from rollout_service.serve.commands import StoredPush
from rollout_service.weights.intake import PushError, PushIntake

CHECKPOINT = {"a": TensorMeta(dtype="bfloat16", shape=(3,)),
              "b": TensorMeta(dtype="float32", shape=(2, 2)),
              "mtp.w": TensorMeta(dtype="bfloat16", shape=(4,))}


def active(num_buckets: int = 0, stream_bytes: int = 0) -> messages.ActivePushState:
    return messages.ActivePushState(push_id="p", client="sglang", target="both", version=1,
                                    group_id="g", num_buckets=num_buckets,
                                    stream_bytes=stream_bytes, num_tensors=0)


def specs(*names: str) -> list[weight_stream.TensorSpec]:
    return [weight_stream.TensorSpec(name=n, dtype=CHECKPOINT[n].dtype,
                                     shape=CHECKPOINT[n].shape) for n in names]


def test_one_broadcast_per_tensor_each_at_an_aligned_offset_after_the_stream() -> None:
    update = weight_stream.layout(specs("a", "b"), active(2, 70), packed_bytes=None)
    assert [(b.index, b.offset, b.nbytes, b.checksum) for b in update.buckets or ()] == [
        (2, 128, 6, None), (3, 192, 16, None)]
    assert [t.location.offset for t in update.tensors] == [128, 192]


def test_packed_chunks_close_once_past_the_buffer_as_vllm_packs_them() -> None:
    # vLLM's pack_tensors: a(6) -> 6, b(16) -> 22 > 8: close; mtp.w(8) alone
    update = weight_stream.layout(specs("a", "b", "mtp.w"), active(), packed_bytes=8)
    assert [(b.offset, b.nbytes) for b in update.buckets or ()] == [(0, 22), (64, 8)]
    assert [t.location.offset for t in update.tensors] == [0, 6, 64]


def test_versions_are_decimal_integers_or_the_next() -> None:
    status = messages.WeightStatus(main_version=4, draft_version=3, active_push_id=None,
                                   consistent=True, last_push=None)
    assert weight_stream.parse_version(None, status, field="weight_version") == 5
    assert weight_stream.parse_version("12", status, field="weight_version") == 12
    with pytest.raises(PushError, match="weight_version: 'step-1' is not a decimal"):
        weight_stream.parse_version("step-1", status, field="weight_version")


def test_lists_of_other_lengths_and_unknown_dtypes_are_refused_naming_the_field() -> None:
    with pytest.raises(PushError, match="dtypes, shapes: 1 dtypes and 2 shapes for 2"):
        weight_stream.specs(["a", "b"], ["bfloat16"], [[3], [2, 2]], dtype_field="dtypes")
    with pytest.raises(PushError, match="dtype_names: 'complex64'"):
        weight_stream.specs(["a"], ["complex64"], [[3]], dtype_field="dtype_names")


def begin(**changes: object) -> messages.PushBeginRequest:
    body = {"version": 2, "transport": "nccl", "group_id": "g", "params": None,
            "client": "sglang", **changes}
    return messages.PushBeginRequest.model_validate(body)


def placed(name: str, offset: int, dtype: str | None = None) -> TensorPlacement:
    meta = CHECKPOINT[name]
    return TensorPlacement(name=name, dtype=dtype or meta.dtype, shape=meta.shape,
                           location=BroadcastLocation(offset=offset))


def update(push_id: str, *tensors: TensorPlacement, index: int = 0,
           nbytes: int = 64) -> messages.PushUpdateRequest:
    return messages.PushUpdateRequest(push_id=push_id, tensors=list(tensors), buckets=[
        messages.BucketInfo(index=index, offset=index * 64, nbytes=nbytes, checksum=None)])


async def test_tensors_named_by_the_updates_are_checked_against_the_checkpoint() -> None:
    intake = PushIntake(CHECKPOINT, timeout_s=60.0, has_draft=True, transport="nccl")
    push_id = intake.begin(begin(), {"main": 1, "draft": 1}).push_id
    assert intake.active is not None and intake.active.state().client == "sglang"
    with pytest.raises(PushError, match="'b' is bfloat16 \\[2, 2\\], the served model has "
                                        "float32"):
        intake.update(update(push_id, placed("b", 0, dtype="bfloat16")))
    push_id = intake.begin(begin(), {"main": 1, "draft": 1}).push_id
    intake.update(update(push_id, placed("a", 0)))
    with pytest.raises(PushError, match="finish: tensor 'b' was never sent"):
        intake.start_loading(push_id)
    assert intake.active is None


async def test_a_drafter_push_may_carry_part_and_finish_names_the_version() -> None:
    intake = PushIntake(CHECKPOINT, timeout_s=60.0, has_draft=True, transport="nccl")
    push_id = intake.begin(begin(target="draft"), {"main": 3, "draft": 1}).push_id
    intake.update(update(push_id, placed("mtp.w", 0)))
    with pytest.raises(PushError, match="version: 1 is not newer than the draft"):
        intake.start_loading(push_id, version=1, versions={"main": 3, "draft": 1})
    push_id = intake.begin(begin(target="draft"), {"main": 3, "draft": 1}).push_id
    intake.update(update(push_id, placed("mtp.w", 0)))
    push = intake.start_loading(push_id, version=3, versions={"main": 3, "draft": 1})
    assert (push.request.version, push.request.total_bytes) == (3, 8)
    assert [p.name for p in push.ordered_placements()] == ["mtp.w"]


async def test_a_complete_push_is_announced_as_what_arrived() -> None:
    """Once a push whose updates named its tensors is complete, its begin names them:
    an announcement the Ray Serve replicas' load takes as any push's (a StoredPush
    validates it again; with total_bytes and no params it was refused, a 500 of every
    framework's sync through the ingress)."""
    intake = PushIntake(CHECKPOINT, timeout_s=60.0, has_draft=True, transport="nccl")
    push_id = intake.begin(begin(), {"main": 1, "draft": 1}).push_id
    intake.update(update(push_id, placed("a", 0), placed("b", 64), placed("mtp.w", 128),
                         nbytes=136))
    push = intake.start_loading(push_id)
    stored = StoredPush(push_id=push_id, begin=push.request,
                        placements=push.ordered_placements())
    assert [p.name for p in stored.begin.params or ()] == ["a", "b", "mtp.w"]
    assert (stored.begin.total_bytes, stored.begin.version) == (6 + 16 + 8, 2)


def test_params_may_be_left_out_for_nccl_only() -> None:
    with pytest.raises(ValueError, match="params: required by transport 'shm'"):
        messages.PushBeginRequest.model_validate({"version": 1, "segment": "s",
                                                  "segment_bytes": 8})
    with pytest.raises(ValueError, match="buckets: only buckets of the frameworks"):
        messages.PushUpdateRequest(push_id="p", buckets=[messages.BucketInfo(
            index=0, offset=0, nbytes=8, checksum="0" * 16)])


def test_the_nccl_unique_id_is_read_from_the_pickle_without_unpickling() -> None:
    from vllm.distributed.device_communicators.pynccl_wrapper import ncclUniqueId

    uid = ncclUniqueId()
    for i in range(128):
        uid.internal[i] = i - 64
    assert unique_id_bytes(pickle.dumps(uid)) == bytes(bytearray(uid.internal))
    with pytest.raises(ValueError, match="not vLLM's pickled ncclUniqueId"):
        unique_id_bytes(pickle.dumps(("os", "system", b"x" * 128)))


def _marker_pickles(marker: Path) -> list[bytes]:
    """Pickles whose loading runs ``os.system("touch <marker>")``: GLOBAL and REDUCE
    (protocol 0); the same in binary framing beside the 128 bytes an id has; and vLLM's
    own pickle of an ``ncclUniqueId`` (its globals, its 128 bytes) with the call slipped
    in before it."""
    from vllm.distributed.device_communicators.pynccl_wrapper import ncclUniqueId

    command = f"touch {marker}".encode()
    call = (b"cposix\nsystem\nX" + len(command).to_bytes(4, "little") + command
            + b"\x85R0")
    genuine = pickle.dumps(ncclUniqueId(), protocol=2)
    assert genuine.startswith(b"\x80\x02")
    return [b"cos\nsystem\n(S'" + command + b"'\ntR.",
            b"\x80\x02C\x80" + b"\x00" * 128 + b"0" + call + b"N.",
            b"\x80\x02" + call + genuine[2:]]


@pytest.mark.parametrize("which", range(3))
def test_a_malicious_pickle_in_the_store_is_refused_and_never_runs(
        which: int, tmp_path: Path) -> None:
    """What the trainer's store holds under vLLM's unique-id key is read by walking the
    pickle's opcodes: a pickle that would run os.system when loaded is refused, and the
    command never runs (nothing is unpickled)."""
    marker = tmp_path / "ran"
    payload = _marker_pickles(marker)[which]
    with pytest.raises(ValueError, match="not vLLM's pickled ncclUniqueId"):
        unique_id_bytes(payload)
    assert not marker.exists()
    pickle.loads(payload)  # the same bytes, unpickled: they do run it
    assert marker.exists()


@pytest.mark.parametrize("payload", [b"", b"\xff\xff", b"\x80\x04\x95",
                                     b"\x80\x04\x8e" + b"\xff" * 7 + b"\x7f"])
def test_a_payload_that_is_no_pickle_is_refused_as_such(payload: bytes) -> None:
    with pytest.raises(ValueError):
        unique_id_bytes(payload)


def test_pickled_handles_are_refused_and_the_framing_rides_in_the_group_id() -> None:
    with pytest.raises(ValueError, match="ipc_handles_pickled: pickled CUDA IPC handles are "
                                         "refused"):
        vllm_wire.NCCLUpdateInfo.model_validate({
            "names": ["a"], "dtype_names": ["bfloat16"], "shapes": [[3]],
            "ipc_handles_pickled": "gAS="})
    info = vllm_wire.NCCLInitInfo.model_validate({
        "master_address": "h", "master_port": 29500, "rank_offset": 1, "world_size": 2,
        "packed": True, "packed_buffer_size_bytes": 1024})
    assert group_id(info) == "vllm-29500-p1024"


def request(authorization: str | None) -> Request:
    headers = [] if authorization is None else [(b"authorization", authorization.encode())]
    return Request({"type": "http", "headers": headers})


async def test_the_weights_token_as_bearer_or_as_the_urls_password() -> None:
    guard = dialect_weights_guard("s3cret", "weights_token")
    assert guard is not None
    await guard(request("Bearer s3cret"))
    await guard(request("Basic " + base64.b64encode(b"weights:s3cret").decode()))
    for wrong in (None, "Bearer nope", "Basic " + base64.b64encode(b"s3cret:").decode()):
        with pytest.raises(Unauthorized, match="http://weights:<token>@host:port"):
            await guard(request(wrong))
    closed = dialect_weights_guard(None, "weights_token")
    assert closed is not None
    with pytest.raises(Forbidden, match="dialect_weights_auth: none"):
        await closed(request("Bearer s3cret"))
    assert dialect_weights_guard(None, "none") is None
