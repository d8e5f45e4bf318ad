"""The ``sglang.launch_server`` commands this project builds, read by SGLang's own argparse
and resolved by its own pipeline, on the CPU (opt-in).

What is built here: the command of a service with ``engine: sglang`` on the embedded model,
the test target's and the smoke run's servers, and the serving benchmark's. Each is parsed
by SGLang's ``prepare_server_args`` and resolved by ``ServerArgs.resolve_once`` (the
speculative, attention and memory decisions SGLang makes before it touches a GPU, with
``--device cuda`` given so that no accelerator is probed) in a child process of an
interpreter on which ``import sglang`` works: ``SGLANG_PYTHON`` (the sglang bundle as
``tools/gpu/bundle/local_check.sh sglang`` installs it: its venv's python3, with
``SGLANG_PYTHONPATH`` its site and ``LD_LIBRARY_PATH`` its CUDA stand-ins).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from typing import Any

import pytest

from bench.serving_sglang import launch_command, sglang_config
from bench.sglang_server import EAGER_SERVER_ARGS
from rollout_service.config import EMBEDDED_SGLANG_ENGINE_KWARGS, load_config
from rollout_service.embedded import ensure_model
from rollout_service.engines.sglang.launch import build_launch_command, service_launch_command
from rollout_service.engines.speculative import MTPSettings
from rollout_service.local import engine_spec

pytestmark = pytest.mark.skipif(not os.environ.get("SGLANG_PYTHON"), reason=(
    "set SGLANG_PYTHON (and SGLANG_PYTHONPATH) to an interpreter on which sglang imports"))

RESOLVE = """
import json, sys
from sglang.srt.server_args import prepare_server_args
args = prepare_server_args(json.loads(sys.argv[1]) + ["--device", "cuda"])
args.resolve_once()
print(json.dumps(args.resolved_dict(), default=str))
"""


def resolved(command: list[str]) -> dict[str, Any]:
    """SGLang's resolved server arguments for ``command`` (its ``python -m`` dropped)."""
    assert command[1:3] == ["-m", "sglang.launch_server"]
    env = {**os.environ, "PYTHONPATH": os.environ.get("SGLANG_PYTHONPATH", "")}
    done = subprocess.run([os.environ["SGLANG_PYTHON"], "-c", RESOLVE, json.dumps(command[3:])],
                          capture_output=True, text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def service_command(mtp: dict[str, Any], server_args: dict[str, Any]) -> list[str]:
    spec = engine_spec(load_config(model="embedded:tiny", engine="sglang", mtp=mtp,
                                   engine_kwargs=server_args))
    return service_launch_command(spec.model_path, spec.engine_kwargs, spec.mtp,
                                  host="127.0.0.1", port=25000)


def test_the_test_targets_service_launches_eagle_over_the_mtp_layer() -> None:
    args = resolved(service_command({"num_speculative_tokens": 2}, EAGER_SERVER_ARGS))
    assert (args["speculative_algorithm"], args["speculative_num_steps"],
            args["speculative_eagle_topk"], args["speculative_num_draft_tokens"]) == \
        ("EAGLE", 2, 1, 3)
    # The drafter is read from the served checkpoint itself (ModelConfig falls back to
    # model_path, and MiMoForCausalLM becomes MiMoMTP as a draft).
    assert args["speculative_draft_model_path"] is None
    assert (args["attention_backend"], args["sampling_backend"], args["context_length"],
            args["dtype"], args["disable_cuda_graph"]) == ("fa3", "pytorch", 1024, "auto", True)
    assert args["max_running_requests"] == 48  # SGLang's cap under speculative decoding
    assert args["log_level_http"] == "warning"  # the service logs each request itself


def test_the_live_tests_own_server_and_a_server_without_speculation() -> None:
    own = build_launch_command(
        str(ensure_model("tiny")), {**EMBEDDED_SGLANG_ENGINE_KWARGS, **EAGER_SERVER_ARGS,
                                    "enable_metrics": True, "disable_radix_cache": True},
        MTPSettings(num_speculative_tokens=2), host="127.0.0.1", port=25001)
    args = resolved(own)
    assert args["enable_metrics"] and args["disable_radix_cache"]
    assert args["speculative_algorithm"] == "EAGLE"
    plain = resolved(service_command({"enabled": False}, EAGER_SERVER_ARGS))
    assert plain["speculative_algorithm"] is None


def test_the_serving_benchmarks_servers() -> None:
    opts = argparse.Namespace(model="embedded:small", num_speculative_tokens=1,
                              gpu_memory_utilization=0.25, eager=False, sglang_kwargs={})
    args = resolved(launch_command(sglang_config(opts, max_concurrency=512), port=25002))
    assert (args["max_running_requests"], args["disable_cuda_graph"],
            args["speculative_num_draft_tokens"]) == (512, False, 2)
    assert args["tokenizer_worker_num"] == 1


def test_the_serving_benchmarks_front_end_in_two_processes() -> None:
    """``SGLANG_KWARGS='{"tokenizer_worker_num": 2}'`` (``--sglang-kwargs``): a flag SGLang
    takes."""
    opts = argparse.Namespace(model="embedded:small", num_speculative_tokens=1,
                              gpu_memory_utilization=0.25, eager=False,
                              sglang_kwargs={"tokenizer_worker_num": 2})
    args = resolved(launch_command(sglang_config(opts, max_concurrency=512), port=25003))
    assert (args["tokenizer_worker_num"], args["max_running_requests"]) == (2, 512)
