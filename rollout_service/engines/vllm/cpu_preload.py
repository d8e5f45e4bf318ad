"""Preload tcmalloc and Intel OpenMP into vLLM's CPU engine processes.

vLLM's CPU worker warns that speculative decoding without Intel OpenMP
(``libiomp5``) and tcmalloc in ``LD_PRELOAD`` "will cause significant performance
loss". vLLM's CPU platform itself prepends libraries to ``LD_PRELOAD`` before it
spawns the engine (``vllm/platforms/cpu.py``), so the variable set here, in the
service process before the engine starts, reaches the engine-core and worker
processes. ``make venv`` installs tcmalloc (Debian's ``libtcmalloc-minimal4``) and
Intel OpenMP (PyPI's ``intel-openmp``, ``<venv>/lib/libiomp5.so``); a missing one
is left out.

Measured with ``bench/serving.py --modes service,service-no-preload`` on the
embedded tiny model, 2-core CPU machine: see docs/benchmarks.md.
``ROLLOUT_CPU_PRELOAD=0`` turns it off.

One OpenMP runtime only: vLLM's CPU platform preloads PyTorch's GNU OpenMP (``libgomp``)
into ``LD_PRELOAD`` of the process that builds an engine config when it finds no OpenMP
there, and its engine refuses to start with both (``vllm/utils/ompmultiprocessing.py``
asserts it). A process that built a config before (a test, a benchmark in-process) would
hand both to every engine it starts next; the GNU one is dropped when Intel's is added.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

SWITCH_ENV = "ROLLOUT_CPU_PRELOAD"
TCMALLOC_CANDIDATES = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                       "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4")


def cpu_preload_libraries() -> list[str]:
    """Paths of tcmalloc and Intel OpenMP that exist on this machine."""
    found = [path for path in TCMALLOC_CANDIDATES if Path(path).exists()][:1]
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    if iomp.exists():
        found.append(str(iomp))
    return found


def preload_for_cpu_engine() -> list[str]:
    """On vLLM's CPU platform, add the libraries to ``LD_PRELOAD`` for the engine
    processes started after this call; returns what was added."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or os.environ.get(SWITCH_ENV, "1") == "0":
        return []
    current = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p]
    libraries = cpu_preload_libraries()
    if any("libiomp" in lib for lib in libraries):
        current = [p for p in current if "libgomp" not in Path(p).name]
    added = [lib for lib in libraries if lib not in current]
    preload = ":".join([*added, *current])
    if preload != os.environ.get("LD_PRELOAD", ""):
        os.environ["LD_PRELOAD"] = preload
        logger.info("LD_PRELOAD for vLLM's CPU engine: %s", preload)
    return added
