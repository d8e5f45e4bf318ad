"""The ``cuda_ipc`` transport's checks that need no GPU: messages, the handle
codec's validation, intake validation and the vLLM update info.

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

from rollout_service.config import ServiceConfig
from rollout_service.protocol import messages
from rollout_service.protocol.cuda_ipc import CudaIpcHandle, export_byte_buffer, export_handle
from rollout_service.protocol.placement import CudaIpcLocation, ShmLocation, TensorPlacement
from rollout_service.protocol.tensors import TensorMeta, contiguous_stride, view_in
from rollout_service.weights.intake import (
    ActivePush,
    PushError,
    build_update,
    check_no_overlap,
    validate_announcement,
    validate_placement,
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


def begin(transport: str = "cuda_ipc", **changes: object) -> messages.PushBeginRequest:
    body = {"version": 3, "transport": transport, "total_bytes": 36,
            "params": [{"name": n, "shape": list(m.shape), "dtype": m.dtype}
                       for n, m in CHECKPOINT.items()]}
    body.update(changes)
    return messages.PushBeginRequest.model_validate(body)


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


def placed(name: str, handle: dict, **changes: object) -> dict:
    """A cuda_ipc placement as a trainer sends it."""
    meta = CHECKPOINT[name]
    body = {"name": name, "dtype": meta.dtype, "shape": list(meta.shape),
            "location": {"transport": "cuda_ipc", "handle": handle}}
    body.update(changes)
    return body


def test_placement_states_its_transport_and_matches_its_handle() -> None:
    placement = TensorPlacement.model_validate(placed("w", handle_fields()))
    assert placement.transport == "cuda_ipc" and placement.nbytes == 24
    with pytest.raises(ValidationError, match="location"):
        TensorPlacement.model_validate(placed("w", handle_fields()) | {"location": {
            "transport": "nccl"}})
    with pytest.raises(ValidationError, match=r"location.handle.shape: the handle describes "
                                              r"\[4, 3\], the announcement \[3, 4\]"):
        TensorPlacement.model_validate(placed("w", handle_fields(), shape=[3, 4]))
    with pytest.raises(ValidationError, match="location.handle.dtype"):
        TensorPlacement.model_validate(placed("w", handle_fields(), dtype="float16"))


@pytest.mark.parametrize("changes,field,needle", [
    ({"storage_handle": "not base64!"}, "storage_handle", "not valid base64"),
    ({"event_handle": "QUJ"}, "event_handle", "not valid base64"),
    ({"ref_counter_handle": ""}, "ref_counter_handle", "empty handle"),
    ({"dtype": "float33"}, "dtype", "dtype: 'float33' is not a tensor dtype"),
    ({"dtype": "torch.bfloat16"}, "dtype", "is not a tensor dtype"),
    ({"stride": [1, 4]}, "", "stride: [1, 4] is not the contiguous stride [3, 1]"),
    ({"shape": [4, -3], "stride": [-3, 1]}, "shape.1", "greater than or equal to 0"),
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
        messages.PushUpdateRequest.model_validate({"push_id": "p", "tensors": [
            placed("w", handle_fields(**changes))]})
    assert needle in field_errors(info.value)
    assert "tensors.0.location.cuda_ipc.handle" in field_errors(info.value)


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


BUFFER = {"shape": [64], "stride": [1], "dtype": "uint8", "storage_size_bytes": 64}
"""A byte buffer of 64 bytes (the trainer's staging buffer)."""


def test_a_byte_buffer_holds_tensors_at_offsets() -> None:
    """Both tensors of CHECKPOINT in one 64-byte buffer: w (24 bytes) at 0, b at 32."""
    buffer = handle_fields(**BUFFER)
    for name, offset in (("w", 0), ("b", 32), ("w", 40), ("b", 52)):
        body = placed(name, buffer)
        body["location"]["offset"] = offset
        placement = TensorPlacement.model_validate(body)
        assert isinstance(placement.location, CudaIpcLocation)
        assert placement.location.offset == offset
    for name, offset, needle in (
            ("w", 1, "location.offset: 1 is not a multiple of 2, the size of a bfloat16"),
            ("b", 34, "location.offset: 34 is not a multiple of 4"),
            ("w", 42, "location.offset: the tensor's bytes 42..66 end past the buffer's 64"),
            ("b", 56, "location.offset: the tensor's bytes 56..68 end past the buffer's 64")):
        body = placed(name, buffer)
        body["location"]["offset"] = offset
        with pytest.raises(ValidationError, match=needle):
            TensorPlacement.model_validate(body)
    # A handle that is a tensor (not a byte buffer) has it at offset 0 only.
    body = placed("w", handle_fields())
    body["location"]["offset"] = 2
    with pytest.raises(ValidationError, match="location.offset: 2 lies in a byte buffer only"):
        TensorPlacement.model_validate(body)
    body["location"]["offset"] = -1
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        TensorPlacement.model_validate(body)


def test_tensors_overlapping_in_one_buffer_are_refused() -> None:
    staged = CudaIpcHandle.model_validate(handle_fields(**BUFFER))
    other = CudaIpcHandle.model_validate(handle_fields(**BUFFER, ref_counter_offset=8))

    def at(name: str, handle: CudaIpcHandle, offset: int) -> TensorPlacement:
        meta = CHECKPOINT[name]
        return TensorPlacement(name=name, dtype=meta.dtype, shape=meta.shape,
                               location=CudaIpcLocation(handle=handle, offset=offset))

    check_no_overlap([at("w", staged, 0), at("b", staged, 24)])  # adjacent
    check_no_overlap([at("w", staged, 0), at("b", other, 0)])  # two exports
    with pytest.raises(PushError, match="tensors: 'b' overlaps 'w' in its CUDA IPC buffer"):
        check_no_overlap([at("w", staged, 0), at("b", staged, 20)])


def test_view_in_reads_the_bytes_at_the_offset_without_a_copy() -> None:
    w = torch.arange(12, dtype=torch.bfloat16).view(4, 3)
    b = torch.tensor([1.5, -2.0, 3.25])
    buffer = torch.zeros(64, dtype=torch.uint8)
    view_in(buffer, 0, [4, 3], "bfloat16").copy_(w)
    view_in(buffer, 32, [3], "float32").copy_(b)
    assert torch.equal(view_in(buffer, 0, [4, 3], "bfloat16"), w)
    got = view_in(buffer, 32, [3], "float32")
    assert torch.equal(got, b) and got.data_ptr() == buffer.data_ptr() + 32
    assert view_in(w, 0, [4, 3], "bfloat16") is w  # a handle that is the tensor itself


def test_every_export_is_opened_once_and_shared_by_its_tensors(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker opens the staging buffer once for all its tensors (torch counts
    opens per export), and a tensor exported on its own once more."""
    from rollout_service.engines.vllm import cuda_ipc_backend

    w = torch.arange(12, dtype=torch.bfloat16).view(4, 3)
    buffer = torch.zeros(64, dtype=torch.uint8)
    view_in(buffer, 0, [4, 3], "bfloat16").copy_(w)
    own_b = torch.tensor([1.5, -2.0, 3.25])
    staged = CudaIpcHandle.model_validate(handle_fields(**BUFFER))
    alone = CudaIpcHandle.model_validate(handle_fields(
        shape=[3], stride=[1], dtype="float32", storage_size_bytes=12, ref_counter_offset=8))
    memory = {staged.export_key: buffer, alone.export_key: own_b}
    opens: list[tuple[str, str, int]] = []

    def open_handle(handle: CudaIpcHandle, *, device_index: int) -> torch.Tensor:
        opens.append(handle.export_key)
        return memory[handle.export_key]

    monkeypatch.setattr(cuda_ipc_backend, "open_handle", open_handle)
    placements = [
        TensorPlacement(name="w", dtype="bfloat16", shape=(4, 3),
                        location=CudaIpcLocation(handle=staged, offset=0)),
        TensorPlacement(name="w2", dtype="bfloat16", shape=(4, 3),
                        location=CudaIpcLocation(handle=staged, offset=24)),
        TensorPlacement(name="b", dtype="float32", shape=(3,),
                        location=CudaIpcLocation(handle=alone)),
    ]
    weights = dict(cuda_ipc_backend.open_placements(placements, device_index=0))
    assert opens == [staged.export_key, alone.export_key]
    assert torch.equal(weights["w"], w) and weights["b"] is own_b
    assert weights["w2"].data_ptr() == buffer.data_ptr() + 24


def test_cpu_tensors_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'lm_head.weight' is on cpu"):
        export_handle(torch.zeros(2, 2), "lm_head.weight")
    with pytest.raises(ValueError, match="'lm_head.weight' is on cpu.*use transport 'shm'"):
        shareable(torch.zeros(2, 2), "lm_head.weight")
    with pytest.raises(ValueError, match=r"staging: a byte buffer is 1-D uint8, got "
                                         r"torch.float32 \[2, 2\]"):
        export_byte_buffer(torch.zeros(2, 2), "staging")


# --- session ------------------------------------------------------------------

def active(req: messages.PushBeginRequest) -> ActivePush:
    expected = validate_announcement(req, CHECKPOINT, transport=req.transport)
    return ActivePush(push_id="p1", request=req, expected=expected, timeout_s=60.0)


def test_announcement_transport_must_be_the_services() -> None:
    with pytest.raises(PushError, match="transport: 'cuda_ipc' is not this service's weights "
                                        "transport 'shm'") as info:
        validate_announcement(begin(), CHECKPOINT)
    assert info.value.status == 400
    with pytest.raises(PushError, match="transport: 'shm'"):
        validate_announcement(begin("shm", segment="mtp-x", segment_bytes=64), CHECKPOINT,
                              transport="cuda_ipc")
    assert set(validate_announcement(begin(), CHECKPOINT, transport="cuda_ipc")) == {"w", "b"}


def test_placements_must_match_the_push_transport_and_announcement() -> None:
    push = active(begin())
    on_shm = TensorPlacement(name="w", dtype="bfloat16", shape=(4, 3),
                             location=ShmLocation(segment="mtp-x", offset=0))
    with pytest.raises(PushError, match="'w' lies in 'shm', and the push's transport is "
                                        "'cuda_ipc'"):
        validate_placement(push, on_shm)
    reshaped = TensorPlacement.model_validate(
        placed("w", handle_fields(shape=[3, 4], stride=[4, 1]), shape=[3, 4]))
    with pytest.raises(PushError, match=r"tensors: 'w' is placed as bfloat16 \[3, 4\], begin "
                                        r"announced bfloat16 \[4, 3\]"):
        validate_placement(push, reshaped)
    retyped = TensorPlacement.model_validate(
        placed("w", handle_fields(dtype="float16"), dtype="float16"))
    with pytest.raises(PushError, match=r"tensors: 'w' is placed as float16 \[4, 3\], begin "
                                        r"announced bfloat16"):
        validate_placement(push, retyped)


def test_cuda_ipc_placement_on_an_shm_push_is_refused() -> None:
    from rollout_service.protocol.shm import Segment

    with Segment.create("mtp-rollout-test-cuda-ipc", 128) as segment:
        push = active(begin("shm", segment=segment.name, segment_bytes=128))
        placement = TensorPlacement.model_validate(placed("w", handle_fields()))
        with pytest.raises(PushError, match="'w' lies in 'cuda_ipc', and the push's transport "
                                            "is 'shm'"):
            validate_placement(push, placement)


def test_complete_push_becomes_the_engines_update_info() -> None:
    from rollout_service.engines.vllm.transfer import PushUpdateInfo, update_info

    push = active(begin(target="both"))
    handles = {"w": CudaIpcHandle.model_validate(handle_fields()),
               "b": CudaIpcHandle.model_validate(handle_fields(
                   shape=[3], stride=[1], dtype="float32", storage_size_bytes=12))}
    for name in ("b", "w"):  # sent in another order than announced
        placement = TensorPlacement(name=name, dtype=handles[name].dtype,
                                    shape=tuple(handles[name].shape),
                                    location=CudaIpcLocation(handle=handles[name]))
        validate_placement(push, placement)
        push.placements[name] = placement
    update = build_update(push)
    assert update.transport == "cuda_ipc"
    assert [p.name for p in update.tensors] == list(CHECKPOINT)  # announcement order
    infos = [update_info(update, is_last_load=update.is_last_load(draft=draft))
             for draft in (False, True)]
    assert [i["is_last_load"] for i in infos] == [False, True]  # drafter loads last
    for info in infos:
        parsed = PushUpdateInfo(**json.loads(json.dumps(info)))  # JSON-safe
        assert parsed.placements == list(update.tensors) and parsed.push_id == "p1"
        with pytest.raises(ValueError, match="this engine loads 'shm' pushes"):
            parsed.check_transport("shm")
    bad = json.loads(json.dumps(infos[0]))
    bad["tensors"][0]["location"]["handle"]["storage_handle"] = "%%"
    with pytest.raises(ValidationError, match="storage_handle"):
        PushUpdateInfo(**bad)
    with pytest.raises(ValueError, match="tensors: 'w' lies in 'cuda_ipc', the update is 'shm'"):
        PushUpdateInfo(**{**infos[0], "transport": "shm"})


def test_config_and_engine_args_select_the_backend() -> None:
    from rollout_service.engines.vllm.engine_args import build_engine_args
    from rollout_service.engines.vllm.plugin import BACKENDS

    assert ServiceConfig().weights_transport == "shm"
    with pytest.raises(ValidationError, match="weights_transport: 'cuda_ipc' is built for "
                                              "engine 'vllm' only"):
        ServiceConfig(engine="sglang", weights_transport="cuda_ipc")
    with pytest.raises(ValidationError, match="weights_transport"):
        ServiceConfig(weights_transport="rdma")
    args = build_engine_args("/nonexistent", {}, ServiceConfig().mtp, None,
                             weights_transport="cuda_ipc")
    assert args.weight_transfer_config.backend == "cuda_ipc"
    args = build_engine_args("/nonexistent", {}, ServiceConfig().mtp, None,
                             weights_transport="nccl")
    assert args.weight_transfer_config.backend == "rollout_nccl"  # vLLM's own is "nccl"
    assert set(BACKENDS) == {"shm", "cuda_ipc", "rollout_nccl"}


# --- the push's staging buffer (begin's cuda_ipc_buffer) -----------------------

def in_buffer(name: str, offset: int) -> TensorPlacement:
    """A placement without a handle: the tensor lies in the push's staging buffer."""
    meta = CHECKPOINT[name]
    return TensorPlacement(name=name, dtype=meta.dtype, shape=meta.shape,
                           location=CudaIpcLocation(offset=offset))


def test_the_staging_buffer_is_named_in_begin_for_cuda_ipc_only() -> None:
    buffer = handle_fields(**BUFFER)
    assert begin(cuda_ipc_buffer=buffer).cuda_ipc_buffer.model_dump() == buffer
    with pytest.raises(ValidationError, match="cuda_ipc_buffer: not used by transport 'shm'"):
        begin("shm", segment="mtp-seg", segment_bytes=64, cuda_ipc_buffer=buffer)
    with pytest.raises(ValidationError) as info:  # a staging buffer is 1-D uint8
        begin(cuda_ipc_buffer=handle_fields())
    assert "cuda_ipc_buffer.dtype: Input should be 'uint8'" in field_errors(info.value)
    assert "cuda_ipc_buffer.shape: List should have at most 1 item" in field_errors(info.value)


def test_placements_in_the_staging_buffer_are_checked_against_it() -> None:
    push = active(begin(cuda_ipc_buffer=handle_fields(**BUFFER)))
    validate_placement(push, in_buffer("w", 0))
    validate_placement(push, in_buffer("b", 52))  # its last byte is the buffer's last
    with pytest.raises(PushError, match=r"tensors: 'b' \[56, 68\) lies outside the 64-byte "
                                        r"staging buffer \(cuda_ipc_buffer\)"):
        validate_placement(push, in_buffer("b", 56))
    with pytest.raises(PushError, match="'w' offset 3 is not aligned to its 2-byte"):
        validate_placement(push, in_buffer("w", 3))
    without = active(begin())
    with pytest.raises(PushError, match="tensors: 'w' has no handle, and begin announced no "
                                        "cuda_ipc_buffer"):
        validate_placement(without, in_buffer("w", 0))


def test_tensors_overlapping_in_the_staging_buffer_are_refused() -> None:
    staged = CudaIpcHandle.model_validate(handle_fields(**BUFFER))
    check_no_overlap([in_buffer("w", 0), in_buffer("b", 24)], staged)
    with pytest.raises(PushError, match="tensors: 'b' overlaps 'w' in its CUDA IPC buffer"):
        check_no_overlap([in_buffer("w", 0), in_buffer("b", 20)], staged)
    # The same offsets in the buffer and in another export do not meet.
    own = TensorPlacement(name="b", dtype="float32", shape=(3,), location=CudaIpcLocation(
        handle=CudaIpcHandle.model_validate(handle_fields(
            shape=[3], stride=[1], dtype="float32", storage_size_bytes=12,
            ref_counter_offset=8))))
    check_no_overlap([in_buffer("w", 0), own], staged)


def test_the_staging_buffer_travels_once_to_the_worker_and_is_opened_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """From begin to the worker: the update carries the buffer's handle once, the
    placements their offsets only, and the worker opens the buffer once for all."""
    from rollout_service.engines.vllm import cuda_ipc_backend
    from rollout_service.engines.vllm.transfer import PushUpdateInfo, update_info

    staged = CudaIpcHandle.model_validate(handle_fields(**BUFFER))
    push = active(begin(cuda_ipc_buffer=staged.model_dump(mode="json")))
    for placement in (in_buffer("w", 0), in_buffer("b", 32)):
        validate_placement(push, placement)
        push.placements[placement.name] = placement
    update = build_update(push)
    assert update.cuda_ipc_buffer is not None
    assert update.cuda_ipc_buffer.model_dump() == staged.model_dump()
    wire = json.dumps(update_info(update, is_last_load=True))
    assert wire.count(staged.storage_handle) == 1
    info = PushUpdateInfo(**json.loads(wire))
    assert info.staging_buffer == staged

    buffer = torch.zeros(64, dtype=torch.uint8)
    w = torch.arange(12, dtype=torch.bfloat16).view(4, 3)
    view_in(buffer, 0, [4, 3], "bfloat16").copy_(w)
    opens: list[tuple[str, str, int]] = []

    def open_handle(handle: CudaIpcHandle, *, device_index: int) -> torch.Tensor:
        opens.append(handle.export_key)
        return buffer

    monkeypatch.setattr(cuda_ipc_backend, "open_handle", open_handle)
    weights = dict(cuda_ipc_backend.open_placements(info.placements, 0, info.staging_buffer))
    assert opens == [staged.export_key]
    assert torch.equal(weights["w"], w)
    assert weights["b"].data_ptr() == buffer.data_ptr() + 32

    orphaned = json.loads(wire)
    orphaned["cuda_ipc_buffer"] = None
    with pytest.raises(ValueError, match="tensors: 'w' has no handle and the update no "
                                         "cuda_ipc_buffer"):
        PushUpdateInfo(**orphaned)
