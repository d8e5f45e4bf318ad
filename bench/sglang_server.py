"""A live SGLang server started by a benchmark or a test, not by the service: the one the
service is pointed at with ``engine_url``, and the baseline the service is compared with.

Runs ``python -m sglang.launch_server`` as a child process of the caller (its own process
group, its output in a log file) with the arguments the service itself would build for the
same model and settings (``engines/sglang/launch.py``), and reads its own answers: its
``/metrics`` counters (with ``enable_metrics``) and its weight checker. Needs the sglang
package on the interpreter's path and a GPU (the sglang bundle, ``tools/gpu/bundle``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from rollout_service.engines.sglang.launch import build_launch_command, free_port_below_ephemeral
from rollout_service.engines.speculative import MTPSettings
from rollout_service.tools.launch import ChildProcess, wait_http_ok
from rollout_service.tools.scrape import sample_sum

STARTUP_TIMEOUT_S = 300.0

EAGER_SERVER_ARGS = {
    "mem_fraction_static": 0.25,
    "disable_cuda_graph": True,
    "sampling_backend": "pytorch",
    "attention_backend": "fa3",
}
"""``sglang.launch_server`` arguments of the test target's services and the smoke run,
beside the embedded default ``context_length`` and the MTP arguments. Eager (no CUDA
graphs: a start takes seconds, not a capture per batch size); a quarter of the free GPU
memory, so that a test's own server and a second service fit beside the session's;
sampling in PyTorch and FA3 attention (sgl-kernel's, compiled), so that nothing
JIT-compiles FlashInfer kernels with the image's nvcc on the first request. The
checkpoint's own bf16 (``dtype`` auto): FA3 takes no float32."""


@contextmanager
def sglang_server(model_path: str, server_args: Mapping[str, Any], mtp: MTPSettings,
                  log_path: Path, *, startup_timeout_s: float = STARTUP_TIMEOUT_S
                  ) -> Iterator[str]:
    """SGLang serving ``model_path`` until the block ends; yields its URL once ``/health``
    answers 200.

    Raises:
        RuntimeError: it exited first (its log's tail in the message).
        TimeoutError: not healthy within ``startup_timeout_s``.
    """
    port = free_port_below_ephemeral()
    command = build_launch_command(model_path, server_args, mtp, host="127.0.0.1", port=port,
                                   python=sys.executable)
    server = ChildProcess(command, log_path)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http_ok(f"{url}/health", server, startup_timeout_s)
        yield url
    finally:
        server.stop()


def counter(url: str, name: str) -> float:
    """The sum of one of the server's own Prometheus series (``enable_metrics``)."""
    return sample_sum(httpx.get(f"{url}/metrics", timeout=30).text, name)


def own_checksums(url: str) -> dict[str, dict[str, str]]:
    """The server's own weight checker: each model's per-tensor checksums (rank 0)."""
    checksums = {}
    for selector in ("target", "draft"):
        response = httpx.post(f"{url}/weights_checker", timeout=120,
                              json={"action": "checksum", "selector": selector})
        response.raise_for_status()
        checksums[selector] = response.json()["ranks"][0]["checksums"]
    return checksums
