"""Opt-in: the FAKE SGLang server (``fake_sglang``) and the SGLang engine against SGLang's
own sources and deserializer. Every test here skips unless its variable is set.

SGLang cannot serve here, so the other ``test_sglang_*`` modules run the engine against
the fake, in this process, over httpx's ASGI transport; nothing there has run against a
live SGLang server. These checks tie the fake to real SGLang: ``SGLANG_SOURCES``
(unpacked wheels, e.g. ``pip install --no-deps --target /tmp/sglang-0.5.23
sglang==0.5.23``, joined with ``:``) compares the fake's request fields, ``meta_info``
keys and launch flags with SGLang's sources and checks ``/generate`` traffic with
0.5.23's JSON contract; ``SGLANG_PYTHONPATH`` (a path on which ``import sglang`` works)
round-trips a real weight payload through SGLang's own deserializer.
"""

from __future__ import annotations

import ast
import base64
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_service.engines.sglang.launch import build_launch_command
from rollout_service.engines.sglang.stats import SPEC_KEY_GENERATIONS
from tests.support.fake_sglang_profiles import PROFILES
from tests.support.sglang_on_fake import MTP, connect, greedy, make_fake, sent


def _sglang_sources() -> dict[str, Path]:
    dirs = [Path(d) for d in os.environ.get("SGLANG_SOURCES", "").split(os.pathsep) if d]
    return {next(d.glob("sglang-*.dist-info")).name.removeprefix("sglang-")
            .removesuffix(".dist-info"): d for d in dirs}


SOURCES = _sglang_sources()
needs_sources = pytest.mark.skipif(not SOURCES, reason="set SGLANG_SOURCES to unpacked wheels")


def _class_fields(path: Path) -> dict[str, set[str]]:
    """Annotated field names declared in each class body of a source file."""
    return {node.name: {stmt.target.id for stmt in node.body
                        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)}
            for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)}


@needs_sources
@pytest.mark.parametrize("version", sorted(SOURCES))
def test_fake_request_fields_match_sglang(version: str) -> None:
    root = SOURCES[version] / "sglang" / "srt"
    real = _class_fields(root / "managers" / "io_struct.py")
    profile = PROFILES[version]
    for name, fields in profile.models.items():
        own = set(fields)
        if name == "GenerateReqInput":
            assert own <= real[name], name  # the fake declares the fields it uses
        else:
            assert own == real[name], name
    assert ("/begin_weight_update" in (root / "entrypoints" / "http_server.py").read_text()
            ) == profile.has_weight_update_session


@needs_sources
@pytest.mark.parametrize("version", sorted(SOURCES))
def test_meta_info_keys_match_sglang(version: str) -> None:
    source = (SOURCES[version] / "sglang/srt/managers/tokenizer_manager.py").read_text()
    real = set(re.findall(r'meta_info\["(spec_[a-z_]+)"\]', source))
    profile = PROFILES[version]
    emitted = {key for pair in profile.spec_keys for key in pair}
    assert emitted | {"spec_verify_ct", profile.histogram_key} <= real
    accepted, proposed = profile.spec_keys[0]
    assert (accepted, proposed, profile.histogram_key) in SPEC_KEY_GENERATIONS
    # The engine reads the newest names a server emits, and no stale ones remain unread.
    assert {k for generation in SPEC_KEY_GENERATIONS for k in generation[:2]} & real == emitted


@needs_sources
@pytest.mark.parametrize("version", sorted(SOURCES))
def test_launch_flags_are_sglang_server_args(version: str) -> None:
    root = SOURCES[version] / "sglang" / "srt"
    fields = set().union(*_class_fields(root / "server_args.py").values())
    for path in (root / "arg_groups" / "fields").glob("*.py"):  # 0.5.23 splits ServerArgs
        fields |= set().union(*_class_fields(path).values())
    command = build_launch_command("/ckpt", {"tp_size": 2, "enable_draft_weights_cpu_backup":
                                             True}, MTP, host="h", port=1)
    flags = {arg[2:].replace("-", "_") for arg in command if arg.startswith("--")}
    assert flags <= fields


@pytest.mark.skipif("0.5.23" not in SOURCES, reason="set SGLANG_SOURCES to include 0.5.23")
async def test_generate_traffic_meets_sglang_json_contract(checkpoint: str) -> None:
    """Requests and responses decode with 0.5.23's generated /generate contract."""
    path = SOURCES["0.5.23"] / "sglang" / "api" / "v1" / "api_types.py"
    spec = importlib.util.spec_from_file_location("sglang_0_5_23_api_types", path)
    api = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(api)
    fake = make_fake("0.5.23", checkpoint)
    engine = await connect(fake)
    await engine.generate("abc", greedy(3, stop=("x",), seed=1, logprobs=0), "text")
    await engine.generate([1, 2], greedy(3, ignore_eos=True), "ids")
    for body in sent(fake, "/generate"):
        api.GenerateRequest.from_json_value(body)
    for out in fake.responses:
        response = api.GenerateResponse.from_json_value(out)
        assert response.meta_info.finish_reason is not None


@pytest.mark.skipif(not os.environ.get("SGLANG_PYTHONPATH"),
                    reason="set SGLANG_PYTHONPATH to where `import sglang` works")
def test_payload_round_trips_through_sglang_deserializer(tmp_path: Path) -> None:
    """Our process pickles; another, unrelated process unpickles with SGLang's own
    SafeUnpickler and rebuilds the tensors with its FlattenedTensorBucket."""
    name = f"rollout-sglang-payload-{os.getpid()}"
    sender = f"""
import sys, torch
from rollout_service.engines.base import WeightUpdate
from rollout_service.engines.sglang.payload import build_flattened_bucket_payloads
from rollout_service.protocol.placement import ShmLocation, TensorPlacement
from rollout_service.protocol.shm import Segment
def placed(tensor, dtype, shape, offset):
    return TensorPlacement(name=tensor, dtype=dtype, shape=shape,
                           location=ShmLocation(segment={name!r}, offset=offset))
with Segment.create({name!r}, 256) as seg:
    seg.tensor(0, torch.bfloat16, (2, 3)).copy_(torch.arange(6.).view(2, 3))
    seg.tensor(64, torch.int32, (4,)).copy_(torch.tensor([7, 8, 9, 10]))
    update = WeightUpdate(push_id="p", target="main", transport="shm", tensors=(
        placed("a", "bfloat16", (2, 3), 0), placed("b", "int32", (4,), 64)))
    payloads, keep = build_flattened_bucket_payloads(update, 2)
print(payloads[1], flush=True)
sys.stdin.readline()
"""
    receiver = """
import sys
from sglang.srt.utils import MultiprocessingSerializer
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
data = MultiprocessingSerializer.deserialize(sys.stdin.readline().strip())
bucket = FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=data["metadata"])
print({n: t.tolist() for n, t in bucket.reconstruct_tensors()})
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.environ["SGLANG_PYTHONPATH"], "."])}
    send = subprocess.Popen([sys.executable, "-c", sender], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        payload = send.stdout.readline()
        base64.b64decode(payload)  # a base64 string, as SGLang's HTTP API takes it
        received = subprocess.run([sys.executable, "-c", receiver], input=payload, env=env,
                                  capture_output=True, text=True, timeout=300, check=False)
    finally:
        send.communicate("\n", timeout=60)
    assert received.returncode == 0, received.stderr[-3000:]
    assert received.stdout.strip() == str({"a": [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]],
                                           "b": [7, 8, 9, 10]})
