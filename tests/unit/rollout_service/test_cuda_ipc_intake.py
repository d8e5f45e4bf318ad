"""The ``cuda_ipc`` transport's intake checks that need no GPU: a push's announcement and
placements against the service's transport and the announcement, a complete push
becoming the vLLM engine's update info (JSON-safe, drafter last), the config and engine
args that select the backend, and the push's staging buffer (begin's
``cuda_ipc_buffer``), from begin to the worker that opens it once.

The codec itself (export in one process, open in another) runs only on CUDA:
``test_cuda_ipc_gpu.py``. The service-level refusal (a cuda_ipc push to a service
configured with shm) is in ``test_weights_refused.py``. The wire checks are
``test_cuda_ipc_wire.py``.
"""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError

from rollout_service.config import ServiceConfig
from rollout_service.protocol import messages
from rollout_service.protocol.cuda_ipc import CudaIpcHandle
from rollout_service.protocol.placement import CudaIpcLocation, ShmLocation, TensorPlacement
from rollout_service.protocol.tensors import view_in
from rollout_service.weights.intake import (
    ActivePush,
    PushError,
    build_update,
    check_no_overlap,
    validate_announcement,
    validate_placement,
)
from tests.support.cuda_ipc_fields import (
    BUFFER,
    CHECKPOINT,
    begin,
    field_errors,
    handle_fields,
    placed,
)

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


@pytest.mark.parametrize(("target", "last_loads"), [
    ("both", {False: False, True: True}),  # main model, then the drafter: the drafter's
    ("main", {False: True}),
    ("draft", {True: True})])
def test_the_last_load_of_a_push_releases_it(target: str, last_loads: dict[bool, bool]
                                             ) -> None:
    """vLLM loads a push in one session per model, main model first: the worker releases
    what the push opened after the last of them, and only then."""
    from rollout_service.engines.vllm.transfer import update_info

    push = active(begin(target=target))
    placement = TensorPlacement.model_validate(placed("w", handle_fields()))
    validate_placement(push, placement)
    push.placements["w"] = placement
    bias = TensorPlacement.model_validate(placed("b", handle_fields(
        shape=[3], stride=[1], dtype="float32", storage_size_bytes=12), shape=[3],
        dtype="float32"))
    validate_placement(push, bias)
    push.placements["b"] = bias
    update = build_update(push)
    assert {draft: update_info(update, draft=draft)["is_last_load"]
            for draft in last_loads} == last_loads


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
    infos = [update_info(update, draft=draft) for draft in (False, True)]
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
    wire = json.dumps(update_info(update, draft=True))
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
