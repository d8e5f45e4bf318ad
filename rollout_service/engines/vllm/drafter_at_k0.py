"""K = 0 without the drafter: an opt-in change to one speculator object in vLLM's worker.

At K = 0 vLLM 0.32.0's model runner V2 still runs the MTP drafter every step:
``TargetDependentARSpeculator.propose``
(``vllm/v1/worker/gpu/spec_decode/target_dependent_ar/speculator.py``) runs the drafter's
prefill (its forward, logits and a sampled draft), then overwrites the drafts with -1
when ``num_speculative_tokens`` is 0. What that buys is the drafter's KV cache kept in
step with the sequence, so that drafts are as good as ever when K comes back. What it
costs is measured by ``bench/speculation.py`` as ``k=0`` against ``spec-off``: 0.68 and
0.80 of spec-off's throughput per round at 16 requests on the H200
(docs/speculation-control.md). A controller that chooses K = 0 can then never be faster
than that floor.

``speculation_control.drafter_at_k0: skip`` trades the other way: a step at K = 0
returns the -1 drafts at once and runs nothing of the drafter. The drafter's KV cache
then holds nothing for the positions generated at K = 0, so once K comes back its
attention reads stale entries there, and its acceptance may be lower on sequences that
ran through K = 0 (the controller sees that acceptance, as it sees any). What is generated keeps its
distribution: verification decides every token.

How, and fenced: before the engine starts, :func:`check_engine_args` refuses what the
resolved engine config already rules out (another vLLM, model runner V1, data or context
parallelism, adaptive verification), so such a service fails in a second, not after a
whole engine start. Once the engine has started, the service calls
:func:`skip_drafter_at_k0` in every worker (``worker_ext.py``). It replaces
``propose`` on the worker's one speculator *object* (nothing in vLLM's classes changes),
only on the vLLM versions in :data:`SUPPORTED_VLLM_VERSIONS`, only for a speculator of
the class whose K = 0 path is the one described above, only when ``propose`` still takes
the arguments the wrapper reads, and not with data or context parallelism (whose ranks
step the drafter together) or adaptive verification (which reads the drafter's
confidences each step).
Anything else refuses with the reason, and the service does not start. ``auto`` (the
default) skips where both checks pass and runs the drafter otherwise, with the reason in
the log (:func:`resolve`, and ``SpecScheduleMethods.skip_drafter_at_k0`` with
``required=False``).
"""

from __future__ import annotations

import inspect
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.engine.arg_utils import AsyncEngineArgs

    from rollout_service.engines.base import DrafterAtK0

logger = logging.getLogger(__name__)

SUPPORTED_VLLM_VERSIONS = ("0.32.0",)
_MARK = "_rollout_skips_drafter_at_k0"
_ARGUMENTS = ("input_batch", "num_speculative_tokens", "dummy_run", "is_profile")


class DrafterSkipUnsupported(RuntimeError):
    """This worker's vLLM, model runner or speculator is not the one the change is for."""


def resolve(choice: DrafterAtK0, args: AsyncEngineArgs) -> bool:
    """Whether the engine is to skip the drafter at K = 0, decided before it starts.

    ``run``: no. ``skip``: yes, or the reason :func:`check_engine_args` gives. ``auto``:
    yes where that check passes; otherwise no, with the reason logged (the workers still
    check the rest once they run).

    Raises:
        ValueError: ``skip`` on an engine that cannot, naming the field and the reason.
    """
    if choice == "run":
        return False
    try:
        check_engine_args(args)
    except ValueError as exc:
        if choice == "skip":
            raise
        logger.info("speculation control: steps at K = 0 run the drafter (drafter_at_k0: "
                    "auto): %s", exc)
        return False
    return True


def check_engine_args(args: AsyncEngineArgs) -> None:
    """Refuse ``drafter_at_k0: skip`` for an engine its config already rules out (service
    process, before the engine starts; the worker checks the rest once it runs).

    Raises:
        ValueError: naming ``speculation_control.drafter_at_k0`` and the reason.
    """
    from vllm import __version__ as vllm_version

    from rollout_service.engines.vllm.graph_policy import resolve as resolve_config

    field = "speculation_control.drafter_at_k0"
    if vllm_version not in SUPPORTED_VLLM_VERSIONS:
        raise ValueError(f"{field}: 'skip' supports vLLM {SUPPORTED_VLLM_VERSIONS}, not "
                         f"{vllm_version}")
    config = resolve_config(args)
    if not config.use_v2_model_runner:
        raise ValueError(f"{field}: 'skip' changes model runner V2's speculator, and this "
                         "engine runs model runner V1 (vLLM's CPU engine always does); "
                         "use 'run'")
    parallel = config.parallel_config
    if parallel.data_parallel_size > 1 or parallel.prefill_context_parallel_size > 1:
        raise ValueError(f"{field}: 'skip' is not possible with data or context "
                         "parallelism (their ranks run the drafter together); use 'run'")
    if config.speculative_config is not None and (
            config.speculative_config.enable_adaptive_verification):
        raise ValueError(f"{field}: 'skip' is not possible with adaptive verification "
                         "(it reads the drafter's confidences every step); use 'run'")


def skip_drafter_at_k0(model_runner: Any) -> str:
    """Make ``model_runner``'s speculator skip the drafter on steps at K = 0 (idempotent).

    Returns:
        The speculator's class name.

    Raises:
        DrafterSkipUnsupported: naming what differs from the supported setup.
    """
    from vllm import __version__ as vllm_version

    if vllm_version not in SUPPORTED_VLLM_VERSIONS:
        raise DrafterSkipUnsupported(f"vLLM {vllm_version}; supported: "
                                     f"{SUPPORTED_VLLM_VERSIONS}")
    speculator = getattr(model_runner, "speculator", None)
    if speculator is None:
        raise DrafterSkipUnsupported(
            f"{type(model_runner).__name__} has no speculator: model runner V2 (CUDA) "
            "with speculative decoding is needed (the CPU engine runs V1)")
    from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator import (
        TargetDependentARSpeculator,
    )

    if not isinstance(speculator, TargetDependentARSpeculator):
        raise DrafterSkipUnsupported(f"speculator {type(speculator).__name__} is not a "
                                     "TargetDependentARSpeculator (MTP, EAGLE)")
    if getattr(speculator, _MARK, False):
        return type(speculator).__name__
    if getattr(speculator, "pcp_manager", None) is not None or getattr(
            speculator, "dp_size", 1) > 1:
        raise DrafterSkipUnsupported("context or data parallelism: their ranks run the "
                                     "drafter together")
    if getattr(model_runner, "adaptive_verification", None) is not None:
        raise DrafterSkipUnsupported("adaptive verification reads the drafter's "
                                     "confidences of every step")
    parameters = inspect.signature(speculator.propose).parameters
    if missing := [a for a in _ARGUMENTS if a not in parameters]:
        raise DrafterSkipUnsupported(f"propose() no longer takes {missing}")
    speculator.propose = _skipping_at_k0(speculator, speculator.propose)
    setattr(speculator, _MARK, True)
    return type(speculator).__name__


def _skipping_at_k0(speculator: Any, propose: Any) -> Any:
    """``propose`` that, at K = 0 outside dummy and profile runs, returns the -1 drafts
    vLLM's own K = 0 path ends with, without running the drafter."""

    def propose_or_skip(input_batch: Any, *args: Any, num_speculative_tokens: int | None = None,
                        dummy_run: bool = False, is_profile: bool = False,
                        **kwargs: Any) -> Any:
        if num_speculative_tokens == 0 and not dummy_run and not is_profile:
            drafts = speculator.draft_tokens[:input_batch.num_reqs]
            drafts.fill_(-1)
            return drafts
        return propose(input_batch, *args, num_speculative_tokens=num_speculative_tokens,
                       dummy_run=dummy_run, is_profile=is_profile, **kwargs)

    return propose_or_skip
