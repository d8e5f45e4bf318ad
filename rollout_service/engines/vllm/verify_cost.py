"""What a verify step costs next to a plain decode step, measured in vLLM's worker.

Runs inside each vLLM worker process, called once through
``RolloutWorkerExtension.rollout_verify_cost`` (``AsyncLLM.collective_rpc``) right after
the engine starts and before it serves anything. The service divides a sequence's
tokens per verify step by the ratio measured here to estimate the net speed-up of
speculation (``protocol/acceptance.py``).

Why a second cost measurement beside ``step_costs.py``: that one times real engine steps
per K and batch size for the speculation control, but has a K = 0 baseline only at the
batch sizes where the controller ran speculation off or calibrated. The net speed-up
needs a plain-step baseline whatever the controller does (and with the controller off),
so this module measures one, once, before serving.

What it times, with the model runner's own dummy batches (the passes vLLM runs to warm
up and to profile memory), at ``B`` sequences and ``k`` draft tokens, each the fastest
of ``repeats`` runs taken in turn:

- ``P = _dummy_run(B)``: the target over ``B`` one-token sequences, then the drafter's
  ``k`` passes over ``B`` tokens;
- ``D1 = drafter.dummy_run(B)``: the drafter's ``k`` passes over ``B`` tokens alone;
- ``V = _dummy_run(B * (1 + k), uniform_decode=True)``: the target over ``B`` sequences
  of ``1 + k`` tokens (a verify step), then the drafter's ``k`` passes over all of them;
- ``D2 = drafter.dummy_run(B * (1 + k))``.

A plain decode step is the target alone, ``P - D1``. A verify step is the target over
the drafts plus the drafter as it runs in a real step: its first pass over every
verified token, the ``k - 1`` later ones over one token per sequence, so ``(V - D2) +
D2 / k + (k - 1) * D1 / k``. The ratio of the two is ``verify_cost_ratio``.

vLLM's V2 model runner (its default on CUDA for these models, and the one its run-time
K schedule needs) has no drafter dummy run, but its dummy runs draft as a real step
does, and it times each step's target forward and drafting apart with CUDA events
(``runner.step_timing``, what vLLM's own adaptive verification profiles with). There
a plain decode step is the target forward of ``_dummy_run(B)``, and a verify step the
target forward plus drafting of ``_dummy_run(B * (1 + k), uniform_decode=True)``.

Limits (docs/telemetry.md): only the forward passes are timed, not the scheduler,
sampling and rejection sampling, so the per-step overhead (larger with speculation) is
left out; the dummy sequences have no context, so attention over a long context (the
same in both steps, which pulls the real ratio towards 1) is left out too; one batch
size is measured. The dummy-run API is vLLM's own and private: its signature is
checked, and on a mismatch nothing is measured (the ratio stays unknown).
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

SUPPORTED_VLLM = "0.32"
"""The vLLM version whose dummy-run API this module was written against."""
_RUNNER_PARAMS = ("num_tokens", "uniform_decode")
_DRAFTER_PARAMS = ("num_tokens", "use_cudagraphs")


def unsupported_reason(runner: Any, num_speculative_tokens: int) -> str | None:
    """Why the dummy-run API of ``runner`` cannot be timed as this module expects, or None.

    Args:
        runner: the worker's model runner.
        num_speculative_tokens: ``k`` of the served speculative config.
    """
    dummy_run = getattr(runner, "_dummy_run", None)
    if _has_step_timing(runner):
        if dummy_run is None or set(_RUNNER_PARAMS) - set(inspect.signature(dummy_run).parameters):
            return "the V2 model runner's _dummy_run lacks num_tokens or uniform_decode"
        if getattr(runner, "decode_query_len", None) != 1 + num_speculative_tokens:
            return "the V2 runner's decode query length is not 1 + num_speculative_tokens"
        return None
    drafter = getattr(runner, "drafter", None)
    drafter_run = getattr(drafter, "dummy_run", None)
    if dummy_run is None or drafter_run is None:
        return "the model runner has no _dummy_run or no drafter with dummy_run"
    for function, names in ((dummy_run, _RUNNER_PARAMS), (drafter_run, _DRAFTER_PARAMS)):
        missing = set(names) - set(inspect.signature(function).parameters)
        if missing:
            return f"{function.__qualname__} lacks {sorted(missing)}"
    if getattr(runner, "uniform_decode_query_len", None) != 1 + num_speculative_tokens:
        return "the runner's uniform decode length is not 1 + num_speculative_tokens"
    return None


def measure_verify_cost(runner: Any, *, batch_size: int, num_speculative_tokens: int,
                      repeats: int) -> dict[str, float] | None:
    """Time a plain decode step and a verify step at ``batch_size`` (module docstring).

    Args:
        runner: the worker's model runner: V1's ``GPUModelRunner`` (or its CPU
            subclass) or V2's (``vllm/v1/worker/gpu/model_runner.py``).
        batch_size: ``B``, clamped to the runner's ``max_num_seqs`` and token budget.
        num_speculative_tokens: ``k`` (at least 1).
        repeats: runs of each kind; the fastest counts.

    Returns:
        ``{"batch_size", "plain_s", "verify_s", "verify_cost_ratio"}``, or None when the
        API differs from vLLM 0.32's or the timings are inconsistent (logged).
    """
    k = num_speculative_tokens
    reason = unsupported_reason(runner, k)
    if reason is not None:
        logger.warning("verify cost not measured: %s (written for vLLM %s)", reason,
                       SUPPORTED_VLLM)
        return None
    scheduler = runner.scheduler_config
    batch = max(1, min(batch_size, scheduler.max_num_seqs,
                       runner.max_num_tokens // (1 + k)))
    measure = _measure_with_step_timing if _has_step_timing(runner) else _measure_with_drafter_runs
    try:  # telemetry: a failure here must not keep the engine from serving
        return measure(runner, batch, k, repeats)
    except Exception:
        logger.exception("verify cost not measured: the dummy runs failed")
        return None


def _measure_with_drafter_runs(runner: Any, batch: int, k: int,
                               repeats: int) -> dict[str, float] | None:
    """The V1 model runner's measurement (module docstring): P, D1, V and D2."""
    sync = _synchronizer(runner)
    runs: dict[str, Callable[[], object]] = {
        "P": lambda: runner._dummy_run(batch, uniform_decode=False),
        "D1": lambda: runner.drafter.dummy_run(batch, use_cudagraphs=False),
        "V": lambda: runner._dummy_run(batch * (1 + k), uniform_decode=True),
        "D2": lambda: runner.drafter.dummy_run(batch * (1 + k), use_cudagraphs=False),
    }
    best = dict.fromkeys(runs, float("inf"))
    for name, run in runs.items():  # warm-up: first calls allocate and compile
        run()
    # Taken in turn, so a burst of load on the host slows every kind alike.
    for _ in range(repeats):
        for name, run in runs.items():
            sync()
            start = time.perf_counter()
            run()
            sync()
            best[name] = min(best[name], time.perf_counter() - start)
    plain = best["P"] - best["D1"]
    verify = best["V"] - best["D2"] + best["D2"] / k + (k - 1) * best["D1"] / k
    return _result(batch, plain, verify, best)


def _has_step_timing(runner: Any) -> bool:
    """Whether ``runner`` is vLLM's V2 model runner with a drafter (module docstring)."""
    return (getattr(runner, "speculator", None) is not None
            and callable(getattr(getattr(runner, "step_timing", None), "collect", None)))


def _measure_with_step_timing(runner: Any, batch: int, k: int,
                              repeats: int) -> dict[str, float] | None:
    """The V2 model runner's measurement (module docstring), from its step timer."""
    runs = (lambda: runner._dummy_run(batch, uniform_decode=False),
            lambda: runner._dummy_run(batch * (1 + k), uniform_decode=True))
    for run in runs:  # warm-up: first calls allocate and compile
        run()
    with runner.step_timing.collect() as samples:  # one sample per step, in issue order
        for _ in range(repeats):  # taken in turn, as on the other runner
            for run in runs:
                run()
    plain_steps, verify_steps = samples[0::2], samples[1::2]
    if (len(samples) != 2 * repeats or not all(
            p.num_target_tokens < v.num_target_tokens
            for p, v in zip(plain_steps, verify_steps))):
        logger.warning("verify cost not measured: the V2 runner timed %d steps, not %d "
                       "alternating plain and verify ones", len(samples), 2 * repeats)
        return None
    plain = min(s.forward_ms for s in plain_steps) / 1e3
    verify = min(s.forward_ms + s.drafter_ms for s in verify_steps) / 1e3
    return _result(batch, plain, verify, samples)


def _result(batch: int, plain: float, verify: float,
            timings: object) -> dict[str, float] | None:
    """Both runners' answer, or None (logged with ``timings``) when the times disagree."""
    if not 0 < plain < verify * 10:
        logger.warning("verify cost not measured: inconsistent timings %s", timings)
        return None
    return {"batch_size": float(batch), "plain_s": plain, "verify_s": verify,
            "verify_cost_ratio": verify / plain}


def _synchronizer(runner: Any) -> Callable[[], None]:
    """Waits for the device's queued work (CUDA runs asynchronously); a no-op on CPU."""
    device = getattr(runner, "device", None)
    if getattr(device, "type", "cpu") != "cuda":
        return lambda: None
    import torch

    return lambda: torch.cuda.synchronize(device)
