"""The ``cuda_ipc`` transport's wire checks that need no GPU: the begin's fields per
transport, a placement and its handle, the handle codec's validation (each bad field
named, inside a bucket too) and its rebuild arguments for torch, byte buffers holding
tensors at offsets, overlaps, views without a copy, each export opened once by the
worker, and CPU tensors refused by name.

The codec itself (export in one process, open in another) runs only on CUDA:
``test_cuda_ipc_gpu.py``. The intake's checks of a push (announcement, placements,
update info, the staging buffer) are ``test_cuda_ipc_intake.py``.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from pydantic import ValidationError
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from rollout_service.protocol import messages
from rollout_service.protocol.cuda_ipc import CudaIpcHandle, export_byte_buffer, export_handle
from rollout_service.protocol.placement import CudaIpcLocation, TensorPlacement
from rollout_service.protocol.tensors import contiguous_stride, view_in
from rollout_service.weights.intake import PushError, check_no_overlap
from tests.support.cuda_ipc_fields import (
    BUFFER,
    CHECKPOINT,
    begin,
    field_errors,
    handle_fields,
    placed,
)
from trainer_client.push import shareable

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
