"""The SGLang engine's ``cuda_ipc`` transport on the CPU: the payloads the service writes
(``engines/sglang/cuda_ipc_payload.py``), read back without CUDA, and a push through the
push manager into the FAKE SGLang server (``fake_sglang``, via ``sglang_cuda_ipc_payloads``).

Nothing here has run against a live SGLang or a GPU (that is
``tests/integration/rollout_service/test_sglang_cuda_ipc_live.py``). Handles are
well-formed descriptions with made-up bytes; SGLang's ``FlattenedTensorMetadata`` is
stood in for under its module name (``stand_in_for_sglang``). The opt-in tests at the end
hold the payload to SGLang 0.5.23's own sources (``SGLANG_SOURCES``) and deserializer
(``SGLANG_PYTHONPATH``).
"""

from __future__ import annotations

import ast
import base64
import dataclasses
import os
import pickle
import pickletools
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from rollout_service.config import ServiceConfig
from rollout_service.engines.base import EngineSpec, EngineUnavailableError, WeightUpdate
from rollout_service.engines.sglang import engine as sglang_engine
from rollout_service.engines.sglang.cuda_ipc_payload import (
    REBUILD_DEVICE_ARG,
    build_cuda_ipc_payloads,
)
from rollout_service.engines.sglang.payload import build_payloads, load_buckets
from rollout_service.protocol import messages
from rollout_service.protocol.cuda_ipc import ByteBufferHandle, CudaIpcHandle
from rollout_service.protocol.placement import CudaIpcLocation, ShmLocation, TensorPlacement
from rollout_service.protocol.tensors import TensorMeta
from rollout_service.telemetry.weights import WeightMetrics
from rollout_service.weights.manager import WeightPushManager
from tests.support.sglang_cuda_ipc_payloads import (
    ALLOWED_GLOBALS,
    METADATA,
    REBUILD,
    FlattenedTensorMetadata,
    PayloadReadingFake,
    stand_in_for_sglang,
)
from tests.support.sglang_on_fake import SPEC_ARGS, connect, sent

UUID = "GPU-8c2a7e0e-1111-2222-3333-444455556666"


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def handle(seed: int, *, dtype: str = "uint8", shape: tuple[int, ...] = (256,),
           storage_offset: int = 0) -> CudaIpcHandle:
    """A well-formed description, its opaque fields made of ``seed``."""
    stride = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        stride[i] = stride[i + 1] * shape[i + 1]
    return CudaIpcHandle(
        gpu_uuid=UUID, shape=list(shape), stride=stride, storage_offset=storage_offset,
        dtype=dtype, storage_handle=b64(bytes([seed]) * 64), storage_size_bytes=4096,
        storage_offset_bytes=512 * seed, ref_counter_handle=b64(f"/torch_1_{seed}".encode()),
        ref_counter_offset=seed, event_handle=b64(bytes([seed + 1]) * 64),
        event_sync_required=True)


STAGING = ByteBufferHandle.model_validate(handle(1).model_dump())
IN_STAGING = {"a": ("bfloat16", (2, 3), 0), "b": ("float32", (4,), 64),
              "c": ("int32", (2, 2), 128)}


def in_staging(name: str) -> TensorPlacement:
    dtype, shape, offset = IN_STAGING[name]
    return TensorPlacement(name=name, dtype=dtype, shape=shape,
                           location=CudaIpcLocation(offset=offset))


def staged_update(*placements: TensorPlacement, target: str = "main") -> WeightUpdate:
    return WeightUpdate(push_id="p1", target=target, transport="cuda_ipc",
                        tensors=placements or tuple(in_staging(n) for n in IN_STAGING),
                        cuda_ipc_buffer=STAGING)


def named_globals(payload: str) -> list[tuple[str, str]]:
    """The (module, name) pairs a pickle names, read from its opcodes, in order."""
    pushed: list[object] = []
    memo: list[object] = []
    names = []
    for op, arg, _ in pickletools.genops(base64.b64decode(payload)):
        if op.name == "MEMOIZE":
            memo.append(pushed[-1])
        elif op.name in ("BINGET", "LONG_BINGET", "GET"):
            pushed.append(memo[int(arg)])
        elif op.name == "STACK_GLOBAL":
            names.append((pushed[-2], pushed[-1]))
            pushed.append(None)
        elif op.name == "GLOBAL":
            names.append(tuple(arg.split(" ", 1)))
            pushed.append(None)
        elif op.stack_after:
            pushed.append(arg if isinstance(arg, str) else None)
    return names


class Recorder:
    """Stands in for torch's ``rebuild_cuda_tensor`` in the reading process: records its
    arguments and returns the bytes SGLang's worker would map, as a CPU tensor."""

    def __init__(self, flat: torch.Tensor) -> None:
        self.flat = flat
        self.calls: list[tuple] = []

    def __call__(self, *args: object) -> torch.Tensor:
        self.calls.append(args)
        return self.flat


def unpickle_as_sglang(payload: str, flat: torch.Tensor,
                       monkeypatch: pytest.MonkeyPatch) -> tuple[dict, Recorder]:
    """Load the payload as SGLang's worker does after its patch of torch (the name resolved
    in torch's module at load time), with a recorder in place of the CUDA rebuild."""
    recorder = Recorder(flat)
    from torch.multiprocessing import reductions

    with monkeypatch.context() as patch:
        patch.setattr(reductions, "rebuild_cuda_tensor", recorder)
        data = pickle.loads(base64.b64decode(payload, validate=True))
    return data, recorder


def reconstruct(data: dict) -> dict[str, torch.Tensor]:
    """SGLang's ``FlattenedTensorBucket.reconstruct_tensors`` (0.5.23), on whatever the
    flattened tensor is."""
    return {m.name: data["flattened_tensor"][m.start_idx:m.end_idx].view(m.dtype)
            .reshape(m.shape) for m in data["metadata"]}


@pytest.fixture(autouse=True)
def sglang_class(monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in_for_sglang(monkeypatch)


def test_staged_push_is_one_bucket_calling_torchs_rebuild_with_the_handle(
        monkeypatch: pytest.MonkeyPatch) -> None:
    update = staged_update()
    [bucket] = load_buckets(update)
    payloads, keep_alive = build_payloads(bucket, 2)
    assert keep_alive is None and len(payloads) == 2 and payloads[0] == payloads[1]
    names = named_globals(payloads[0])
    assert names.count(REBUILD) == 1 and METADATA in names
    assert set(names) <= ALLOWED_GLOBALS, set(names) - ALLOWED_GLOBALS

    originals = {"a": torch.arange(6, dtype=torch.bfloat16).view(2, 3),
                 "b": torch.tensor([1.5, -2.0, 3.25, 4.0]),
                 "c": torch.tensor([[7, -8], [9, 2**30]], dtype=torch.int32)}
    flat = torch.zeros(256, dtype=torch.uint8)
    for name, tensor in originals.items():
        start = IN_STAGING[name][2]
        flat[start:start + tensor.nbytes] = tensor.flatten().view(torch.uint8)
    data, recorder = unpickle_as_sglang(payloads[0], flat, monkeypatch)
    [args] = recorder.calls
    assert args == STAGING.to_rebuild_args(UUID)
    assert args[REBUILD_DEVICE_ARG] == UUID and args[0] is torch.Tensor
    assert (args[1], args[2], args[5]) == (torch.Size([256]), (1,), torch.uint8)
    assert args[7] == bytes([1]) * 64 and args[11] == b"/torch_1_1" and args[13] == bytes([2]) * 64
    assert [(m.name, m.shape, m.dtype, m.start_idx, m.end_idx, m.numel)
            for m in data["metadata"]] == [
        ("a", torch.Size([2, 3]), torch.bfloat16, 0, 12, 12),
        ("b", torch.Size([4]), torch.float32, 64, 80, 16),
        ("c", torch.Size([2, 2]), torch.int32, 128, 144, 16)]
    assert all(type(m) is FlattenedTensorMetadata for m in data["metadata"])
    rebuilt = reconstruct(data)
    assert all(torch.equal(rebuilt[n], t) for n, t in originals.items())


def test_each_own_export_is_a_bucket_of_its_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor exported in place is read as its bytes (same memory, counter and event);
    a byte buffer of its own holds its tensors at their offsets."""
    own = handle(3, dtype="bfloat16", shape=(2, 3), storage_offset=4)
    buffer = handle(5, shape=(128,))
    update = WeightUpdate(push_id="p2", target="both", transport="cuda_ipc", tensors=(
        TensorPlacement(name="w", dtype="bfloat16", shape=(2, 3),
                        location=CudaIpcLocation(handle=own)),
        TensorPlacement(name="x", dtype="float32", shape=(2,),
                        location=CudaIpcLocation(handle=buffer, offset=64)),
        TensorPlacement(name="y", dtype="int64", shape=(1,),
                        location=CudaIpcLocation(handle=buffer, offset=8))))
    buckets = load_buckets(update)
    assert [[p.name for p in b.tensors] for b in buckets] == [["w"], ["x", "y"]]
    flat = torch.arange(128, dtype=torch.uint8)
    [own_payload], _ = build_payloads(buckets[0], 1)
    data, recorder = unpickle_as_sglang(own_payload, flat, monkeypatch)
    [args] = recorder.calls
    expected = list(own.to_rebuild_args(UUID))
    expected[1:4] = [torch.Size([12]), (1,), 8]  # 12 bytes from byte 8 (element 4)
    expected[5] = torch.uint8
    assert args == tuple(expected)
    assert [(m.name, m.start_idx, m.end_idx) for m in data["metadata"]] == [("w", 0, 12)]
    [buffer_payload], _ = build_payloads(buckets[1], 1)
    data, recorder = unpickle_as_sglang(buffer_payload, flat, monkeypatch)
    assert recorder.calls == [buffer.to_rebuild_args(UUID)]
    assert [(m.name, m.start_idx, m.end_idx, m.numel) for m in data["metadata"]] == [
        ("x", 64, 72, 8), ("y", 8, 16, 8)]
    with pytest.raises(ValueError, match="tensors in several CUDA IPC exports"):
        build_cuda_ipc_payloads(update, 1)


def test_a_push_mixing_shm_and_cuda_ipc_is_refused() -> None:
    mixed = staged_update(in_staging("a"), TensorPlacement(
        name="b", dtype="float32", shape=(4,), location=ShmLocation(segment="seg-1", offset=0)))
    for call in (load_buckets, lambda update: build_payloads(update, 1)):
        with pytest.raises(ValueError, match="push p1: tensor 'b' travels by 'shm'; a "
                                             "'cuda_ipc' push to SGLang lies in CUDA IPC"):
            call(mixed)
    unstaged = dataclasses.replace(staged_update(), cuda_ipc_buffer=None)
    with pytest.raises(ValueError, match="tensor 'a' has no handle and the push no staging"):
        load_buckets(unstaged)


async def test_mixed_push_sends_nothing(checkpoint: str) -> None:
    fake = PayloadReadingFake("0.5.23", model_path=checkpoint, speculative=SPEC_ARGS)
    engine = await connect(fake, payload_builder=build_payloads)
    fake.calls.clear()
    mixed = staged_update(in_staging("a"), TensorPlacement(
        name="b", dtype="float32", shape=(4,), location=ShmLocation(segment="seg-1", offset=0)))
    with pytest.raises(ValueError, match="travels by 'shm'"):
        await engine.load_weights(mixed, version="1")
    assert fake.calls == [] and fake.loads == []


EXPECTED_IPC_CALLS = {
    "0.5.23": (["/pause_generation", "/begin_weight_update", "/update_weights_from_tensor",
                "/update_weights_from_tensor", "/end_weight_update", "/flush_cache",
                "/continue_generation"], {"selector": "all"}),
    "0.5.10": (["/pause_generation", "/update_weights_from_tensor",
                "/update_weights_from_tensor", "/flush_cache", "/continue_generation"],
               {"disable_draft_model": False}),  # its draft path loads drafter and target
}


@pytest.mark.parametrize("version", sorted(EXPECTED_IPC_CALLS))
async def test_cuda_ipc_push_through_the_push_manager(version: str, checkpoint: str) -> None:
    """Staged and in-place exports in one push of main and drafter, TP 2: one request per
    export, for both models at once, the version with the last. Each export reaches
    SGLang once: every request is one open of the trainer's memory, and torch's counter
    of an export (unsigned) frees it only when opened exactly once (a live 0.5.23 held
    every in-place export of two requests per export, one per model)."""
    fake = PayloadReadingFake(version, model_path=checkpoint, speculative=SPEC_ARGS,
                              tp_size=2)
    engine = await connect(fake, payload_builder=build_payloads)
    tensors = {"model.embed_tokens.weight": TensorMeta(shape=(4, 8), dtype="bfloat16"),
               "model.norm.weight": TensorMeta(shape=(8,), dtype="float32"),
               "model.mtp_layers.0.input_proj.weight": TensorMeta(shape=(2, 3),
                                                                  dtype="bfloat16")}
    manager = WeightPushManager(engine, tensors, WeightMetrics(
        registry=CollectorRegistry(), model="tiny", engine="sglang"), timeout_s=30,
        has_draft=True, transport="cuda_ipc")
    begin = await manager.begin(messages.PushBeginRequest(
        version=7, target="both", transport="cuda_ipc", cuda_ipc_buffer=STAGING,
        total_bytes=64 + 32 + 12, params=[messages.ParamSpec(
            name=n, shape=list(m.shape), dtype=m.dtype) for n, m in tensors.items()]))
    own = handle(9, dtype="bfloat16", shape=(2, 3))
    await manager.update(messages.PushUpdateRequest(push_id=begin.push_id, tensors=[
        TensorPlacement(name="model.embed_tokens.weight", dtype="bfloat16", shape=(4, 8),
                        location=CudaIpcLocation(offset=128)),
        TensorPlacement(name="model.norm.weight", dtype="float32", shape=(8,),
                        location=CudaIpcLocation(offset=0)),
        TensorPlacement(name="model.mtp_layers.0.input_proj.weight", dtype="bfloat16",
                        shape=(2, 3), location=CudaIpcLocation(handle=own))]))
    fake.calls.clear()
    await manager.finish(messages.PushFinishRequest(push_id=begin.push_id))

    routes, models = EXPECTED_IPC_CALLS[version]
    assert fake.routes_called() == routes
    loads = sent(fake, "/update_weights_from_tensor")
    assert [body["weight_version"] for body in loads] == [None, "7"]
    for body in loads:
        assert (body["load_format"], body["flush_cache"]) == ("flattened_bucket", False)
        assert {key: body.get(key) for key in models} == models
    opened = [load.payloads[0]["flattened_tensor"].args[7:10] for load in fake.loads]
    assert len(set(opened)) == len(opened) == 2, "each export (handle, size, offset) once"
    for load in fake.loads:
        assert len(load.payloads) == 2 and load.payloads[0] == load.payloads[1]
    staged, in_place = fake.loads[0].payloads[0], fake.loads[1].payloads[0]
    assert staged["flattened_tensor"].args == STAGING.to_rebuild_args(UUID)
    assert [(m.name, tuple(m.shape), m.dtype, m.start_idx, m.end_idx) for m in
            staged["metadata"]] == [
        ("model.embed_tokens.weight", (4, 8), torch.bfloat16, 128, 192),
        ("model.norm.weight", (8,), torch.float32, 0, 32)]
    assert in_place["flattened_tensor"].args[1:7] == (torch.Size([12]), (1,), 0,
                                                      torch.storage.TypedStorage,
                                                      torch.uint8, UUID)
    assert [m.name for m in in_place["metadata"]] == ["model.mtp_layers.0.input_proj.weight"]
    status = manager.status()
    assert (status.main_version, status.draft_version, status.consistent) == (7, 7, True)
    assert fake.weight_version == "7"


@pytest.mark.parametrize("transport", ["cuda_ipc", "nccl"])
async def test_start_takes_every_transport(checkpoint: str, transport: str) -> None:
    spec = EngineSpec(model_path=checkpoint, served_model_name="tiny",
                      weights_transport=transport, engine_url="http://127.0.0.1:9")
    with pytest.raises(EngineUnavailableError):  # past the transport: no server there
        await sglang_engine.start(spec)  # type: ignore[arg-type]
    assert ServiceConfig(engine="sglang", weights_transport=transport).weights_transport == \
        transport


# --- opt-in: against SGLang 0.5.23 itself -------------------------------------------------

SOURCES = Path(os.environ.get("SGLANG_SOURCES", "").split(os.pathsep)[0] or "/nonexistent")


def _module(path: str) -> ast.Module:
    return ast.parse((SOURCES / "sglang" / "srt" / path).read_text())


def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    return next(node for node in ast.walk(tree)
                if isinstance(node, ast.FunctionDef) and node.name == name)


def _calls(function: ast.FunctionDef) -> list[str]:
    return [ast.unparse(node.func) for node in ast.walk(function) if isinstance(node, ast.Call)]


@pytest.mark.skipif(not (SOURCES / "sglang" / "srt").is_dir(),
                    reason="set SGLANG_SOURCES to an unpacked SGLang 0.5.23 wheel")
def test_what_the_payload_relies_on_is_in_sglangs_sources() -> None:
    common = _module("utils/common.py")
    unpickler = next(node for node in ast.walk(common)
                     if isinstance(node, ast.ClassDef) and node.name == "SafeUnpickler")
    allowed = next(ast.literal_eval(stmt.value) for stmt in unpickler.body
                   if isinstance(stmt, ast.Assign)
                   and ast.unparse(stmt.targets[0]) == "ALLOWED_GLOBALS")
    assert ALLOWED_GLOBALS <= allowed, ALLOWED_GLOBALS - allowed
    calls = _calls(_function(_module("managers/tp_worker.py"), "deserialize_own_rank"))
    assert calls.index("monkey_patch_torch_reductions") < calls.index(
        "MultiprocessingSerializer.deserialize")
    patch = _module("utils/patch_torch.py")
    assert f"_REDUCE_TENSOR_ARG_DEVICE_INDEX = {REBUILD_DEVICE_ARG}" in ast.unparse(patch)
    assert "reductions.rebuild_cuda_tensor = _rebuild_cuda_tensor_modified" in \
        ast.unparse(_function(patch, "monkey_patch_torch_reductions"))
    bucket = _module("weight_sync/tensor_bucket.py")
    metadata = next(node for node in ast.walk(bucket)
                    if isinstance(node, ast.ClassDef) and node.name == "FlattenedTensorMetadata")
    assert [stmt.target.id for stmt in metadata.body if isinstance(stmt, ast.AnnAssign)] == [
        field.name for field in dataclasses.fields(FlattenedTensorMetadata)]
    flattened = _function(_module("model_executor/model_runner_components/weight_updater.py"),
                          "_update_weights_from_flattened_bucket")
    assert ".to(" not in ast.unparse(flattened)  # sliced where it lies: on the GPU


@pytest.mark.skipif(not os.environ.get("SGLANG_PYTHONPATH"),
                    reason="set SGLANG_PYTHONPATH to where `import sglang` works")
def test_payload_reads_back_through_sglangs_deserializer() -> None:
    """Built with SGLang's own class, read by its SafeUnpickler with torch's rebuild
    replaced as its worker's patch replaces it, sliced by its FlattenedTensorBucket."""
    script = f"""
import torch
from torch.multiprocessing import reductions
from sglang.srt.utils import MultiprocessingSerializer
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
from tests.unit.rollout_service.test_sglang_cuda_ipc import build_payloads, staged_update, UUID
[payload], _ = build_payloads(staged_update(), 1)
calls = []
reductions.rebuild_cuda_tensor = lambda *a: calls.append(a) or torch.arange(256).to(torch.uint8)
data = MultiprocessingSerializer.deserialize(payload)
assert calls[0][{REBUILD_DEVICE_ARG}] == UUID, calls
bucket = FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=data["metadata"])
print({{n: t.flatten().view(torch.uint8).tolist() for n, t in bucket.reconstruct_tensors()}})
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.environ["SGLANG_PYTHONPATH"], "."])}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == str({
        "a": list(range(12)), "b": list(range(64, 80)), "c": list(range(128, 144))})
