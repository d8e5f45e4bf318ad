"""How vLLM starts its engine-core process: spawned, not forked, on CUDA.

vLLM forks its engine core unless told otherwise (``VLLM_WORKER_MULTIPROC_METHOD``)
or unless it sees CUDA initialized in the parent. A fork copies the parent's locks but
not its threads, and the service's process has threads when it starts the engine
(the start deadline's watchdog, asyncio's executor, the tokenizer's pool); vLLM's own
design notes say fork "is incompatible with dependencies that use threads"
(vllm-project/vllm, ``docs/design/multiprocessing.md``). On the H200, a forked engine
core blocked at start in each of the last three GPU sessions, in some starts and not
others; every stack taken showed it in the first pinned host allocation of the V2
model runner (``UvaBuffer.__init__`` in ``vllm/v1/worker/gpu/buffer_utils.py``), once
with nothing else on the GPU (``docs/what-ran-where.md``). A spawned process starts
from a fresh interpreter, at the cost of importing vLLM once more (seconds, against
minutes of CUDA-graph capture).

The CPU engine keeps vLLM's fork: it never blocked there, and CI's 2-core machine
would pay the second import on every engine start.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

START_METHOD_VARIABLE = "VLLM_WORKER_MULTIPROC_METHOD"


def spawn_engine_core_on_cuda(*, is_cuda: bool,
                              environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Ask vLLM to spawn its engine core on CUDA unless the user chose a method.

    Call before ``AsyncLLM.from_engine_args`` (vLLM reads the variable when it starts
    the engine core). Returns the method now in ``environ``, None when unset.
    """
    if is_cuda:
        environ.setdefault(START_METHOD_VARIABLE, "spawn")
    return environ.get(START_METHOD_VARIABLE)


def spawn_engine_core_if_cuda() -> str | None:
    """:func:`spawn_engine_core_on_cuda` for the platform vLLM detects (through NVML,
    without initializing CUDA in this process)."""
    from vllm.platforms import current_platform

    return spawn_engine_core_on_cuda(is_cuda=current_platform.is_cuda())
