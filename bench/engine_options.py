"""The command-line options of the benchmarks that start vLLM engines: where they run and
how much of the GPU each takes (``bench.serving``, ``bench.speculation``)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rollout_service.engines.vllm.start_method import spawn_engine_core_on_cuda


def json_object(text: str) -> dict[str, Any]:
    """An argparse type: engine kwargs as a JSON object (``--engine-kwargs`` of
    ``bench.weight_sync``, ``--sglang-kwargs`` of ``bench.serving``), merged over a
    bench's defaults.

    Raises:
        argparse.ArgumentTypeError: not JSON, or JSON but not an object.
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def add_device_arguments(parser: argparse.ArgumentParser, *,
                         gpu_memory_utilization: float | None, engines: str) -> None:
    """``--device``, ``--gpu-memory-utilization``, ``--eager`` and ``--logs``, shared by the
    benchmarks that start engines (``engines`` says how many share the GPU)."""
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="default: cuda when vLLM sees a GPU")
    parser.add_argument("--gpu-memory-utilization", type=float,
                        default=gpu_memory_utilization, help=f"per engine, on the GPU ({engines})")
    parser.add_argument("--eager", action="store_true",
                        help="on the GPU: no torch.compile or CUDA graphs (faster start)")
    parser.add_argument("--logs", default=None, help="directory for server logs")


def resolve_device(opts: argparse.Namespace) -> None:
    """Fill ``opts.device`` when not given: cuda when vLLM sees a GPU. On CUDA every
    mode's engine core is spawned, as the service's is (``start_method.py``): the
    variable goes to this process's ``AsyncLLM`` and the servers' environments."""
    if opts.device is None:  # NVML only: CUDA initialized here would break vLLM's fork
        from vllm.platforms import current_platform

        opts.device = "cuda" if current_platform.is_cuda() else "cpu"
    spawn_engine_core_on_cuda(is_cuda=opts.device == "cuda")
