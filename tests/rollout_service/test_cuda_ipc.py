"""The ``cuda_ipc`` transport's checks that need no GPU: wire messages, the handle
codec's validation, session validation and the vLLM update info.

The codec itself (export in one process, open in another) runs only on CUDA:
``test_cuda_ipc_gpu.py``. The service-level refusal (a cuda_ipc push to a
service configured with shm) is in ``test_weights.py``, next to its helpers.
"""

from __future__ import annotations

import base64
import inspect
import json

import pytest
import torch
from pydantic import ValidationError
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from rollout_service import wire
from rollout_service.config import ServiceConfig
from rollout_service.weights.checkpoint import TensorMeta
from rollout_service.weights.cuda_ipc import CudaIpcHandle, contiguous_stride, export_handle
from rollout_service.weights.session import (
    ActivePush,
    PushError,
    build_update,
    validate_announcement,
    validate_slot,
)
from trainer_client.push import shareable

CHECKPOINT = {"w": TensorMeta(shape=(4, 3), dtype="bfloat16"),
              "b": TensorMeta(shape=(3,), dtype="float32")}


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def handle_fields(**changes: object) -> dict:
    """A well-formed description (fields as a trainer on cuda:0 would send them)."""
    fields = {"gpu_uuid": "GPU-8c2a7e0e-0000-0000-0000-000000000000", "shape": [4, 3],
              "stride": [3, 1], "storage_offset": 0, "dtype": "bfloat16",
              "storage_handle": b64(bytes(range(64))), "storage_size_bytes": 24,
              "storage_offset_bytes": 512, "ref_counter_handle": b64(b"/torch_123_456_0"),
              "ref_counter_offset": 7, "event_handle": b64(bytes(64)),
              "event_sync_required": True}
    fields.update(changes)
    return fields


def begin(transport: str = "cuda_ipc", **changes: object) -> wire.PushBeginRequest:
    body = {"version": 3, "transport": transport, "total_bytes": 36,
            "params": [{"name": n, "shape": list(m.shape), "dtype": m.dtype}
                       for n, m in CHECKPOINT.items()]}
    body.update(changes)
    return wire.PushBeginRequest.model_validate(body)


def field_errors(exc: ValidationError) -> str:
    return " | ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())


# --- wire ---------------------------------------------------------------------

def test_begin_segment_fields_follow_the_transport() -> None:
    assert begin().segment is None
    with pytest.raises(ValidationError, match="segment: required by transport 'shm'"):
        begin("shm")
    with pytest.raises(ValidationError, match="segment_bytes: required by transport 'shm'"):
        begin("shm", segment="mtp-seg")
    with pytest.raises(ValidationError, match="segment: not used by transport 'cuda_ipc'"):
        begin(segment="mtp-seg", segment_bytes=64)
    with pytest.raises(ValidationError, match="transport"):
        begin("nccl")


def test_slot_has_exactly_one_location() -> None:
    handle = handle_fields()
    assert wire.TensorSlot.model_validate({"name": "w", "nbytes": 24, "cuda_ipc": handle})
    for body in ({"name": "w", "nbytes": 24},
                 {"name": "w", "nbytes": 24, "offset": 0, "cuda_ipc": handle}):
        with pytest.raises(ValidationError, match="'w' needs exactly one of 'offset'"):
            wire.TensorSlot.model_validate(body)
    with pytest.raises(ValidationError, match="nbytes: 48 for 'w', its cuda_ipc handle "
                                              "describes 24"):
        wire.TensorSlot.model_validate({"name": "w", "nbytes": 48, "cuda_ipc": handle})


@pytest.mark.parametrize("changes,field,needle", [
    ({"storage_handle": "not base64!"}, "storage_handle", "not valid base64"),
    ({"event_handle": "QUJ"}, "event_handle", "not valid base64"),
    ({"ref_counter_handle": ""}, "ref_counter_handle", "empty handle"),
    ({"dtype": "float33"}, "", "dtype: 'float33' is not a tensor dtype"),
    ({"dtype": "torch.bfloat16"}, "", "is not a tensor dtype"),
    ({"stride": [1, 4]}, "", "stride: [1, 4] is not the contiguous stride [3, 1]"),
    ({"shape": [4, -3], "stride": [-3, 1]}, "", "shape: [4, -3] has a negative dim"),
    ({"storage_size_bytes": 22}, "", "storage_size_bytes: 22 cannot hold the tensor"),
    ({"storage_offset": 1}, "", "storage_size_bytes: 24 cannot hold the tensor, which ends"),
    ({"storage_offset_bytes": -1}, "storage_offset_bytes", "greater than or equal to 0"),
    ({"tensor_cls": "torch.nn.Parameter"}, "tensor_cls", "Extra inputs are not permitted"),
    ({"gpu_uuid": ""}, "gpu_uuid", "at least 1 character"),
])
def test_handle_validation_names_the_field(changes: dict, field: str, needle: str) -> None:
    with pytest.raises(ValidationError) as info:
        CudaIpcHandle.model_validate(handle_fields(**changes))
    message = field_errors(info.value)
    assert needle in message and message.startswith(f"{field}:"), message
    # ...and inside a bucket the error is located under the slot's handle
    with pytest.raises(ValidationError) as info:
        wire.PushUpdateRequest.model_validate({"push_id": "p", "tensors": [
            {"name": "w", "nbytes": 24, "cuda_ipc": handle_fields(**changes)}]})
    assert needle in field_errors(info.value)
    assert "tensors.0.cuda_ipc" in field_errors(info.value)


def test_handle_json_round_trip_and_rebuild_args() -> None:
    handle = CudaIpcHandle.model_validate(handle_fields())
    assert CudaIpcHandle.model_validate_json(handle.model_dump_json()) == handle
    args = handle.to_rebuild_args(device_index=5)
    params = list(inspect.signature(rebuild_cuda_tensor).parameters)
    assert len(args) == len(params) == 15
    named = dict(zip(params, args, strict=True))
    # The classes are the ones reduce_tensor sends for a plain tensor, fixed here.
    assert named["tensor_cls"] is torch.Tensor
    assert named["storage_cls"] is type(torch.empty(1)._typed_storage())
    assert named["dtype"] is torch.bfloat16 and named["storage_device"] == 5
    assert named["tensor_size"] == torch.Size([4, 3]) and named["tensor_stride"] == (3, 1)
    assert named["storage_handle"] == bytes(range(64))
    assert named["ref_counter_handle"] == b"/torch_123_456_0"
    assert named["event_handle"] == bytes(64) and named["event_sync_required"] is True
    assert (named["storage_size_bytes"], named["storage_offset_bytes"],
            named["ref_counter_offset"], named["requires_grad"]) == (24, 512, 7, False)


@pytest.mark.parametrize("shape", [[4, 3], [3, 1, 4], [1], [], [2, 0, 5], [7, 1]])
def test_contiguous_stride_is_torchs(shape: list[int]) -> None:
    assert contiguous_stride(shape) == list(torch.empty(shape).stride())


def test_handle_matches_announcement() -> None:
    handle = CudaIpcHandle.model_validate(handle_fields())
    handle.check_matches((4, 3), "bfloat16")
    with pytest.raises(ValueError, match=r"shape: the handle describes \[4, 3\], the "
                                         r"announcement \[3, 4\]"):
        handle.check_matches((3, 4), "bfloat16")
    with pytest.raises(ValueError, match="dtype: the handle describes bfloat16, the "
                                         "announcement float16"):
        handle.check_matches((4, 3), "float16")


def test_cpu_tensors_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'lm_head.weight' is on cpu"):
        export_handle(torch.zeros(2, 2), "lm_head.weight")
    with pytest.raises(ValueError, match="'lm_head.weight' is on cpu.*use transport 'shm'"):
        shareable(torch.zeros(2, 2), "lm_head.weight")


# --- session ------------------------------------------------------------------

def active(req: wire.PushBeginRequest) -> ActivePush:
    expected = validate_announcement(req, CHECKPOINT, transport=req.transport)
    return ActivePush(push_id="p1", request=req, expected=expected)


def test_announcement_transport_must_be_the_services() -> None:
    with pytest.raises(PushError, match="transport: 'cuda_ipc' is not this service's weights "
                                        "transport 'shm'") as info:
        validate_announcement(begin(), CHECKPOINT)
    assert info.value.status == 400
    with pytest.raises(PushError, match="transport: 'shm'"):
        validate_announcement(begin("shm", segment="mtp-x", segment_bytes=64), CHECKPOINT,
                              transport="cuda_ipc")
    assert set(validate_announcement(begin(), CHECKPOINT, transport="cuda_ipc")) == {"w", "b"}


def test_slots_must_match_the_push_transport_and_announcement() -> None:
    push = active(begin())
    shm_slot = wire.TensorSlot(name="w", offset=0, nbytes=24)
    with pytest.raises(PushError, match="'w' has no 'cuda_ipc' handle, and the push's "
                                        "transport is 'cuda_ipc'"):
        validate_slot(push, shm_slot)
    bad_shape = wire.TensorSlot.model_validate({"name": "w", "nbytes": 24, "cuda_ipc": (
        handle_fields(shape=[3, 4], stride=[4, 1]))})
    with pytest.raises(PushError, match=r"tensors: 'w' cuda_ipc.shape: the handle describes "
                                        r"\[3, 4\], the announcement \[4, 3\]"):
        validate_slot(push, bad_shape)
    bad_dtype = wire.TensorSlot.model_validate({"name": "w", "nbytes": 24, "cuda_ipc": (
        handle_fields(dtype="float16"))})
    with pytest.raises(PushError, match="tensors: 'w' cuda_ipc.dtype: the handle describes "
                                        "float16, the announcement bfloat16"):
        validate_slot(push, bad_dtype)


def test_cuda_ipc_slot_on_an_shm_push_is_refused() -> None:
    from rollout_service.weights.shm import Segment

    with Segment.create("mtp-rollout-test-cuda-ipc", 128) as segment:
        push = active(begin("shm", segment=segment.name, segment_bytes=128))
        slot = wire.TensorSlot.model_validate({"name": "w", "nbytes": 24,
                                               "cuda_ipc": handle_fields()})
        with pytest.raises(PushError, match="'w' has no 'offset', and the push's transport "
                                            "is 'shm'"):
            validate_slot(push, slot)


def test_complete_push_becomes_the_engines_update_info() -> None:
    from rollout_service.engines.vllm import _update_info
    from rollout_service.weights.vllm_cuda_ipc import CudaIpcUpdateInfo

    push = active(begin(target="both"))
    handles = {"w": CudaIpcHandle.model_validate(handle_fields()),
               "b": CudaIpcHandle.model_validate(handle_fields(
                   shape=[3], stride=[1], dtype="float32", storage_size_bytes=12))}
    for name, handle in handles.items():
        slot = wire.TensorSlot(name=name, nbytes=handle.nbytes, cuda_ipc=handle)
        validate_slot(push, slot)
        push.slots[name] = slot
    update = build_update(push)
    assert update.transport == "cuda_ipc" and update.segment is None
    infos = [_update_info(update, draft=draft) for draft in (False, True)]
    assert [i["is_last_load"] for i in infos] == [False, True]  # drafter loads last
    for info in infos:
        parsed = CudaIpcUpdateInfo(**json.loads(json.dumps(info)))  # JSON-safe
        assert parsed.names == list(CHECKPOINT) and parsed.push_id == "p1"
        assert parsed.parsed == [handles[n] for n in CHECKPOINT]
    with pytest.raises(ValidationError, match="storage_handle"):
        CudaIpcUpdateInfo(**{**infos[0], "handles": [
            {**infos[0]["handles"][0], "storage_handle": "%%"}, infos[0]["handles"][1]]})


def test_config_and_engine_args_select_the_backend() -> None:
    from rollout_service.engines.vllm import build_engine_args
    from rollout_service.engines.vllm_plugin import BACKENDS

    assert ServiceConfig().weights_transport == "shm"
    with pytest.raises(ValidationError, match="weights_transport: 'cuda_ipc' is built for "
                                              "engine 'vllm' only"):
        ServiceConfig(engine="sglang", weights_transport="cuda_ipc")
    with pytest.raises(ValidationError, match="weights_transport"):
        ServiceConfig(weights_transport="nccl")
    args = build_engine_args("/nonexistent", {}, ServiceConfig().mtp, None,
                             weights_transport="cuda_ipc")
    assert args.weight_transfer_config.backend == "cuda_ipc"
    assert set(BACKENDS) == {"shm", "cuda_ipc"}
