"""Smoke run of the SGLang engine path on a GPU: can SGLang serve the embedded MiMo
checkpoints with their MTP layer as the drafter, alone and behind the service?

Runs in the caller's process on the GPU machine (the sglang bundle on the path,
``tools/gpu/project_env_sglang.sh``); starts SGLang servers and services as child
processes, each stage with its own deadline, and prints one ``STAGE`` line per stage
(``ok`` with what it saw, or ``FAILED`` with the first error lines of the server's log),
then a summary. Stages:

1. ``checkpoints``: build the embedded checkpoints (``ensure_model``) and print what SGLang
   reads of them: architecture, head_dim, MTP layers, dtypes on disk.
2. ``jit``: the toolchain SGLang 0.5.23 compiles some kernels of every model with at run
   time (RoPE, SiLU-and-mul: ``sglang.kernels.jit``, tvm-ffi + ninja + nvcc + c++, linked
   against ``$CUDA_HOME/lib64/libcudart.so``), and those kernels built once into its cache
   (``~/.cache/sglang/jit``), with the compiler's own error when a build fails.
3. ``sglang-tiny``: ``sglang.launch_server`` alone, with the arguments the service builds
   (EAGLE over the checkpoint's MTP layer, the test target's server arguments): one greedy
   ``/generate``, its spec-decode ``meta_info``, ``/server_info``'s resolved speculative
   arguments, the weight checker's tensors of both models. When it fails, the same server
   without speculation (``sglang-tiny-nospec``) says whether MTP is the cause.
4. ``service-tiny``: the service launching SGLang (``engine: sglang``): a batch with
   acceptance, a push of the checkpoint itself (checksums unchanged), health.
5. ``service-1b``: the same on the 1.14B checkpoint (head_dim 128), eager.

    python -m bench.sglang_smoke --logs /tmp/smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from safetensors import safe_open

from bench.sglang_server import EAGER_SERVER_ARGS, own_checksums, sglang_server
from rollout_service.client import RolloutClient
from rollout_service.config import EMBEDDED_SGLANG_ENGINE_KWARGS
from rollout_service.embedded import ensure_model
from rollout_service.engines.speculative import MTPSettings
from rollout_service.protocol import messages
from rollout_service.tools.launch import ServiceProcess

NUM_SPECULATIVE_TOKENS = 2
TOKEN = "smoke-weights-token"
ERROR = re.compile(r"Traceback|Error|error:|FAILED|Exception|exception")
results: list[tuple[str, bool, str]] = []


def stage(name: str, fn: Callable[[], str]) -> bool:
    """Run one stage; record and print its outcome (an exception is its failure)."""
    t0 = time.monotonic()
    try:
        detail = fn()
        ok = True
    except BaseException as exc:  # every stage reports, then the next one runs
        detail = f"{type(exc).__name__}: {str(exc)[-3000:]}"
        ok = False
        traceback.print_exc()
    line = f"STAGE {name}: {'ok' if ok else 'FAILED'} ({time.monotonic() - t0:.0f} s): {detail}"
    print(line, flush=True)
    results.append((name, ok, detail.splitlines()[0][:300] if detail else ""))
    return ok


def log_errors(path: Path, num_lines: int = 40) -> str:
    """The first error lines of a server log with what follows them, else its tail."""
    if not path.exists():
        return f"(no log at {path})"
    lines = path.read_text(errors="replace").splitlines()
    hits = [i for i, line in enumerate(lines) if ERROR.search(line)]
    if not hits:
        return "\n".join(lines[-num_lines:])
    start = hits[0]
    return "\n".join(lines[start:start + num_lines])


def checkpoints(sizes: list[str]) -> str:
    seen = []
    for size in sizes:
        path = ensure_model(size)
        config = json.loads((path / "config.json").read_text())
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            dtypes = sorted({str(f.get_slice(name).get_dtype()) for name in f.keys()})
            num_mtp = sum(1 for name in f.keys() if name.startswith("model.mtp_layers."))
        seen.append(f"{size}: {path} {config['architectures']} model_type "
                    f"{config['model_type']} head_dim {config['head_dim']} hidden "
                    f"{config['hidden_size']} num_nextn_predict_layers "
                    f"{config['num_nextn_predict_layers']} torch_dtype {config['torch_dtype']} "
                    f"on disk {dtypes}, {num_mtp} MTP tensors")
    return "; ".join(seen)


def jit_kernels() -> str:
    import torch

    cuda_home = os.environ.get("CUDA_HOME")
    tools = {name: shutil.which(name) for name in ("nvcc", "c++", "ninja")}
    nvcc = (subprocess.run([tools["nvcc"], "--version"], capture_output=True, text=True,
                           check=False).stdout.strip().splitlines()[-1:] if tools["nvcc"] else [])
    cudart = f"{cuda_home}/lib64/libcudart.so"
    seen = [f"CUDA_HOME {cuda_home}", f"tools {tools}", f"nvcc {nvcc}",
            f"{cudart} there: {bool(cuda_home) and os.path.exists(cudart)}"]
    from sglang.kernels.ops.activation.activation import activation_module
    from sglang.kernels.ops.attention import rope

    builds = {"activation bf16": lambda: activation_module(torch.bfloat16),
              "rotary_embedding": rope._jit_rotary_embedding_module,
              **{f"fused_rope {d}": (lambda d=d: rope._jit_fused_rope_module(
                  True, d, torch.bfloat16, torch.bfloat16)) for d in (64, 128)}}
    for name, build in builds.items():
        t0 = time.monotonic()
        try:
            build()
        except Exception as exc:  # the compiler's output is in the message
            raise RuntimeError(f"{'; '.join(seen)}; building {name}: {exc}") from exc
        seen.append(f"{name} {time.monotonic() - t0:.0f} s")
    return "; ".join(seen)


def sglang_alone(logs: Path, name: str, mtp: MTPSettings) -> str:
    args = {**EMBEDDED_SGLANG_ENGINE_KWARGS, **EAGER_SERVER_ARGS, "enable_metrics": True}
    log = logs / f"{name}.log"
    try:
        with sglang_server(str(ensure_model("tiny")), args, mtp, log) as url:
            out = httpx.post(f"{url}/generate", timeout=120, json={
                "input_ids": [5, 17, 42, 9], "sampling_params": {
                    "max_new_tokens": 32, "temperature": 0.0, "ignore_eos": True}}).json()
            info = httpx.get(f"{url}/server_info", timeout=30).json()
            meta = {k: v for k, v in out["meta_info"].items() if k.startswith("spec_")}
            resolved = {k: info.get(k) for k in (
                "speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk",
                "speculative_num_draft_tokens", "speculative_draft_model_path",
                "attention_backend", "sampling_backend", "dtype", "max_running_requests",
                "context_length", "version")}
            detail = (f"output_ids[:8] {out['output_ids'][:8]}; meta_info {meta}; "
                      f"server_info {resolved}")
            if mtp.enabled:
                checks = own_checksums(url)
                detail += (f"; weight checker: target {len(checks['target'])} tensors, draft "
                           f"{sorted(checks['draft'])}")
            return detail
    except BaseException as exc:
        raise RuntimeError(f"{exc}\n-- {log}:\n{log_errors(log)}") from exc


async def _use_service(url: str) -> str:
    async with RolloutClient(url) as client:
        batch = await client.generate_batch(messages.BatchGenerateRequest(requests=[
            messages.GenerateRequest(prompt_token_ids=[5 + i, 17, 42], max_tokens=48,
                                     temperature=0.0, ignore_eos=True) for i in range(8)]))
        health = await client.health()
    acceptance = batch.acceptance
    first = batch.responses[0].outputs[0].spec_decode
    return (f"health {health.status} engine {health.engine} speculation "
            f"{health.speculation}; macro accept rate {acceptance.macro_accept_rate}, "
            f"accept length {acceptance.macro_accept_length}; first sequence {first}")


def service(logs: Path, size: str, server_args: dict[str, Any]) -> str:
    from safetensors.torch import load_file

    from trainer_client.push import WeightPusher

    config = logs / f"service-{size}.json"
    config.write_text(json.dumps({
        "model": f"embedded:{size}", "engine": "sglang", "engine_kwargs": server_args,
        "mtp": {"num_speculative_tokens": NUM_SPECULATIVE_TOKENS}, "weights_token": TOKEN,
        "engine_start_timeout_s": 400}))
    log = logs / f"service-{size}.log"
    try:
        with ServiceProcess(log, config=config) as proc:
            proc.wait_healthy(timeout_s=420)
            detail = asyncio.run(_use_service(proc.url))
            headers = {"authorization": f"Bearer {TOKEN}"}
            before = httpx.get(f"{proc.url}/weights/checksums", headers=headers,
                               timeout=120).json()
            tensors = load_file(str(ensure_model(size) / "model.safetensors"))
            with WeightPusher(proc.url, TOKEN, transport="shm") as pusher:
                report = pusher.push(tensors.items(), version=1, target="both")
            after = httpx.get(f"{proc.url}/weights/checksums", headers=headers,
                              timeout=120).json()
            if after != before:
                raise RuntimeError(f"a push of the checkpoint itself changed the checksums: "
                                   f"{before} -> {after}")
            return (f"{detail}; push of the checkpoint: {report.num_bytes / 1e6:.0f} MB in "
                    f"{report.total_s:.3f} s, checksums unchanged {after}")
    except BaseException as exc:
        raise RuntimeError(f"{exc}\n-- {log}:\n{log_errors(log)}") from exc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logs", type=Path, default=Path("/tmp/sglang-smoke"))
    parser.add_argument("--sizes", default="tiny,small,1b", help="checkpoints to build")
    parser.add_argument("--skip", default="", help="comma-separated stages to skip")
    opts = parser.parse_args()
    opts.logs.mkdir(parents=True, exist_ok=True)
    skip = set(opts.skip.split(","))
    mtp = MTPSettings(num_speculative_tokens=NUM_SPECULATIVE_TOKENS)
    stage("checkpoints", lambda: checkpoints(opts.sizes.split(",")))
    if "jit" not in skip:
        stage("jit", jit_kernels)
    if "sglang-tiny" not in skip and not stage(
            "sglang-tiny", lambda: sglang_alone(opts.logs, "sglang-tiny", mtp)):
        stage("sglang-tiny-nospec",
              lambda: sglang_alone(opts.logs, "sglang-tiny-nospec", MTPSettings(enabled=False)))
    if "service-tiny" not in skip:
        stage("service-tiny", lambda: service(opts.logs, "tiny", EAGER_SERVER_ARGS))
    if "service-1b" not in skip and "1b" in opts.sizes:
        stage("service-1b", lambda: service(opts.logs, "1b", EAGER_SERVER_ARGS))
    print("SMOKE SUMMARY")
    for name, ok, first_line in results:
        print(f"  {'ok    ' if ok else 'FAILED'} {name}: {first_line}")
    sys.exit(0 if all(ok for _, ok, _ in results) else 1)


if __name__ == "__main__":
    main()
