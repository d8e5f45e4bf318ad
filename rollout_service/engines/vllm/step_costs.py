"""Engine step costs from vLLM's own per-step stats: a stat logger in the front end.

Runs in the rollout service process, inside ``AsyncLLM``'s output handler: vLLM calls
every stat logger once per batch of engine-core outputs (one engine step) with that step's
``SchedulerStats`` and ``IterationStats``. :class:`StepCostMonitor` turns the clean decode
steps into :class:`~rollout_service.speculation.cost.StepCostSample` values for whoever
subscribed (the service's speculation control), and remembers the last step's batch size.
O(B) per step: the median of the step's inter-token latencies.

What a step's cost is: ``IterationStats.inter_token_latencies_iter`` holds, per request that
decoded in the step, the time since its previous token, both timestamps taken in the engine
core when it packs its outputs (``vllm/v1/metrics/stats.py``, ``update_from_output``). For a
request that had a token in the previous step too, that is the engine-core period between
two steps: drafting, verification and the scheduler's own work, without the front end's
event-loop delays. Nothing is added to vLLM for it.

A step is a clean decode step, and becomes a sample, when:

- it has outputs and no prompt tokens nor first tokens (no prefill, whole or chunked, of
  a request that produced a token);
- every running request produced an output (``len(itl) == num_running_reqs + finished``:
  a running request without one is a prefill chunk sharing the step);
- its K is uniform: no drafts (K = 0), or one draft per request of exactly K tokens each
  (``num_draft_tokens == K * num_drafts``, ``num_drafts == B``); a request whose draft was
  cut short (near ``max_tokens`` or the context end) makes it non-uniform;
- the previous step was clean: its outputs' timestamps are then this step's start. B may
  have fallen by the requests that finished in the previous step: the interval is still
  this step's work at its own B. (Requiring the same B as well left a decaying rollout,
  where requests finish nearly every step, with no sample above the calibration.)
- the next step is clean with the same K. A step verifies the drafts the step before
  proposed and proposes those the next one verifies (vLLM's model runner drafts at the
  K scheduled for the step), so after a change of K one step verifies the old K and
  drafts the new: its sample leaves when the next step shows what it drafted, and only if
  that is its own K. Each sample reaches the subscribers one step late.

Its cost is the median of the step's inter-token latencies. Limits: B is the number of
requests in the step, not their context lengths (a step at long contexts costs more, and
the table blends that in over time); a pause of the engine between two steps (a weight
push in ``keep`` mode) inflates one step, which the medians downstream absorb; with
asynchronous scheduling (vLLM's GPU default) the period is still the engine core's, so
overlap of CPU and GPU work is included as it really happens.
"""

from __future__ import annotations

import functools
import logging
import statistics
from collections.abc import Callable
from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase

from rollout_service.speculation.cost import StepCostSample

logger = logging.getLogger(__name__)

StepCostSink = Callable[[StepCostSample], None]


def decode_step(scheduler_stats: Any, iteration_stats: Any) -> StepCostSample | None:
    """One step's sample if it is a clean decode step at a uniform K (module docstring),
    the previous-step condition aside; else None."""
    if scheduler_stats is None or iteration_stats is None:
        return None
    latencies = iteration_stats.inter_token_latencies_iter
    if (not latencies or iteration_stats.num_prompt_tokens
            or iteration_stats.time_to_first_tokens_iter):
        return None
    batch_size = len(latencies)
    if batch_size != scheduler_stats.num_running_reqs + len(iteration_stats.finished_requests):
        return None
    spec = scheduler_stats.spec_decoding_stats
    num_drafts = spec.num_drafts if spec is not None else 0
    if num_drafts == 0:
        k = 0
    else:
        k, rest = divmod(spec.num_draft_tokens, num_drafts)
        if rest or num_drafts != batch_size or k == 0:
            return None
    step_s = statistics.median(latencies)
    if step_s <= 0:
        return None
    return StepCostSample(k=k, batch_size=batch_size, step_s=step_s)


class StepCostMonitor:
    """Clean decode steps of one engine, as samples to the subscribers.

    Subscribers run in vLLM's output handler: they must be quick. One that raises is
    logged and skipped; the exception must not reach vLLM, whose output handler would die
    with it (and every request with the engine).
    """

    def __init__(self) -> None:
        self._sinks: list[StepCostSink] = []
        self._is_previous_clean = False
        """Whether the previous step was a clean decode step."""
        self._held: StepCostSample | None = None
        """The previous step's sample, if the step before it was clean too: sent once this
        step shows it drafted its own K."""
        self.batch_size = 0
        """Requests that produced an output in the last step with outputs."""
        self.num_steps = 0
        """Steps with outputs seen so far: what a caller counts to act every few steps."""

    def subscribe(self, sink: StepCostSink) -> None:
        """Send every clean decode step's sample to ``sink`` from now on."""
        self._sinks.append(sink)

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        """Take in one step's stats (the stat logger's ``record``)."""
        if iteration_stats is not None:
            num_outputs = (len(iteration_stats.inter_token_latencies_iter)
                           + len(iteration_stats.time_to_first_tokens_iter))
            if num_outputs:
                self.batch_size = num_outputs
                self.num_steps += 1
        sample = decode_step(scheduler_stats, iteration_stats)
        held = self._held
        self._held = sample if self._is_previous_clean else None
        self._is_previous_clean = sample is not None
        if held is not None and sample is not None and sample.k == held.k:
            for sink in self._sinks:
                try:
                    sink(held)
                except Exception:  # an exception here would kill vLLM's output handler
                    logger.exception("step-cost subscriber failed on %s", held)

    def logger_factory(self) -> Callable[..., StatLoggerBase]:
        """A per-engine ``StatLoggerFactory`` for ``AsyncLLM(stat_loggers=[...])``."""
        return functools.partial(_StepCostLogger, monitor=self)


class _StepCostLogger(StatLoggerBase):
    """vLLM's stat-logger interface around a :class:`StepCostMonitor` (vLLM's default
    loggers, Prometheus included, stay)."""

    def __init__(self, vllm_config: Any, engine_index: int = 0, *,
                 monitor: StepCostMonitor) -> None:
        self._monitor = monitor

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        self._monitor.record(scheduler_stats, iteration_stats)

    def log_engine_initialized(self) -> None:
        pass
