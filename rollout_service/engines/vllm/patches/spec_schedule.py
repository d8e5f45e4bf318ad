"""Run-time K schedule for vLLM 0.32.0: two utility methods added to ``EngineCore``.

Runs in vLLM's engine-core process, installed by the ``rollout_weight_transfer``
``vllm.general_plugins`` entry point (``plugin.register``; vLLM calls it in every one of its
processes, the engine core included, before the core is built). The service's front end
calls the methods with ``AsyncLLM.engine_core.call_utility_async(name, *args)``; vLLM runs a
utility call in the engine core's busy loop, between two steps.

Why a patch: vLLM 0.32.0 builds its batch size -> K lookup (``Scheduler.dynamic_sd_lookup``,
from ``speculative_config.num_speculative_tokens_per_batch_size``) once, in
``Scheduler.__init__``, and reads it at every ``schedule()``; it has no call to change it. The
runners (V1, CPU included, and V2) take the K of each step from the scheduler's output, so
swapping the lookup is the whole change, effective from the next step. Nothing is replaced:
two methods are added, and a plain ``vllm serve`` never calls them.

- ``rollout_set_spec_schedule(ranges)``: builds the lookup with vLLM's own builder (which
  validates the ranges) and swaps the reference. Refused, with the lookup unchanged and the
  engine serving on: an engine started without a schedule (no lookup to swap: vLLM then
  pads every decode to the maximum K), ranges that are not integer triples, a K above the
  engine's ``num_speculative_tokens`` (vLLM would clamp it silently; the buffers, the KV
  lookahead and the CUDA graphs are sized for that maximum), and whatever vLLM's validator
  refuses (the first range must start at 1, no overlap). The failure comes back to the
  caller as the utility call's exception.
- ``rollout_get_spec_schedule()``: the lookup in force and the facts it depends on.

Fenced: only on the vLLM versions listed (a warning and nothing installed on any other);
the builder's signature, the scheduler output's per-step K field and the scheduler's use of
the lookup are checked first, and a mismatch raises at start-up.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)

SUPPORTED_VLLM_VERSIONS = ("0.32.0",)
SET_METHOD = "rollout_set_spec_schedule"
GET_METHOD = "rollout_get_spec_schedule"
_EXPECTED_BUILDER_PARAMETERS = ("num_speculative_tokens_per_batch_size", "vllm_max_batch_size",
                                "vllm_num_speculative_tokens")


def check_ranges(ranges: object, max_k: int) -> list[tuple[int, int, int]]:
    """What vLLM's own validator lets through but must not pass here.

    vLLM converts each value with ``int()`` (so ``"2"`` and ``2.9`` pass) and clamps K to its
    maximum without a word; the rest (positive, sorted, non-overlapping ranges from 1) is
    its validator's business.

    Raises:
        ValueError: not a list of ``[start, end, K]`` integer triples, or a K above ``max_k``.
    """
    if not isinstance(ranges, list | tuple) or not ranges:
        raise ValueError(f"ranges must be a non-empty list of [start, end, K], got {ranges!r}")
    triples = []
    for entry in ranges:
        if (not isinstance(entry, list | tuple) or len(entry) != 3
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in entry)):
            raise ValueError(f"each range must be [start, end, K] of integers, got {entry!r}")
        start, end, k = entry
        if k > max_k:
            raise ValueError(f"K={k} in range [{start}, {end}] exceeds the engine's "
                             f"num_speculative_tokens={max_k}, the most it can run (its "
                             f"buffers and graphs are sized at start-up)")
        triples.append((start, end, k))
    return triples


def set_spec_schedule(core: Any, ranges: Sequence[Sequence[int]]) -> list[int]:
    """``EngineCore.rollout_set_spec_schedule``: swap the scheduler's K lookup.

    Returns:
        The new lookup from batch size 1 on (``lookup[i]``: K at batch size ``i + 1``).

    Raises:
        RuntimeError: the engine started without a schedule.
        ValueError: bad ranges (see :func:`check_ranges` and vLLM's validator).
    """
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    scheduler = core.scheduler
    if not isinstance(getattr(scheduler, "dynamic_sd_lookup", None), list):
        raise RuntimeError("the engine started without speculative_config."
                           "num_speculative_tokens_per_batch_size: its K cannot change at run "
                           "time")
    max_k = scheduler.num_spec_tokens
    triples = check_ranges(ranges, max_k)
    lookup = build_dynamic_sd_schedule_lookup(
        [list(t) for t in triples], vllm_max_batch_size=scheduler.scheduler_config.max_num_seqs,
        vllm_num_speculative_tokens=max_k)
    # One reference swap, in the busy-loop thread between steps: the next schedule() reads it.
    scheduler.dynamic_sd_lookup = lookup
    return lookup[1:]


def get_spec_schedule(core: Any) -> dict[str, Any]:
    """``EngineCore.rollout_get_spec_schedule``: the lookup in force (None without one) and
    what it depends on."""
    scheduler = core.scheduler
    lookup = getattr(scheduler, "dynamic_sd_lookup", None)
    config = core.vllm_config
    return {"lookup": None if lookup is None else list(lookup[1:]),
            "num_speculative_tokens": scheduler.num_spec_tokens,
            "max_num_seqs": scheduler.scheduler_config.max_num_seqs,
            "use_v2_model_runner": bool(config.use_v2_model_runner),
            "async_scheduling": bool(config.scheduler_config.async_scheduling)}


def _rollout_set_spec_schedule(self: Any, ranges: list) -> list[int]:
    return set_spec_schedule(self, ranges)


def _rollout_get_spec_schedule(self: Any) -> dict[str, Any]:
    return get_spec_schedule(self)


_METHODS = {SET_METHOD: _rollout_set_spec_schedule, GET_METHOD: _rollout_get_spec_schedule}


def apply() -> bool:
    """Add the two methods to vLLM's ``EngineCore`` when this vLLM is supported; returns
    whether they are there.

    Raises:
        RuntimeError: a supported version whose scheduler no longer has what the methods
            rely on, or an ``EngineCore`` that already has a different method of that name.
    """
    from vllm import __version__ as vllm_version

    if vllm_version not in SUPPORTED_VLLM_VERSIONS:
        logger.warning("vLLM %s is not in %s: the run-time K schedule is not installed; the "
                       "speculation controller cannot change K", vllm_version,
                       SUPPORTED_VLLM_VERSIONS)
        return False
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    parameters = tuple(inspect.signature(build_dynamic_sd_schedule_lookup).parameters)
    problems = []
    if parameters != _EXPECTED_BUILDER_PARAMETERS:
        problems.append(f"build_dynamic_sd_schedule_lookup has parameters {parameters}, "
                        f"expected {_EXPECTED_BUILDER_PARAMETERS}")
    if "num_spec_tokens_to_schedule" not in SchedulerOutput.__dataclass_fields__:
        problems.append("SchedulerOutput has no num_spec_tokens_to_schedule")
    for method in (Scheduler.__init__, Scheduler.schedule):
        if "self.dynamic_sd_lookup" not in inspect.getsource(method):
            problems.append(f"Scheduler.{method.__name__} no longer uses dynamic_sd_lookup")
    if problems:
        raise RuntimeError(f"the run-time K schedule for vLLM {vllm_version} no longer "
                           f"matches: {'; '.join(problems)}; update {__name__}")
    for name, method in _METHODS.items():
        present = getattr(EngineCore, name, None)
        if present is not None and present is not method:
            raise RuntimeError(f"vLLM's EngineCore already has a {name}: {__name__} would "
                               "replace it")
        setattr(EngineCore, name, method)
    return True
