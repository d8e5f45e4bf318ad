"""Every PromQL expression of the rollout service, written once.

Pure string rendering, no Prometheus client and no I/O. Read by the Grafana
dashboard (``deploy/grafana/dashboards.py``), the recording rules and alerts
(``deploy/prometheus/rules.py``, through ``telemetry/alerts.py``), ``rollout-service
look`` (range queries from the operator's process) and ``docs/telemetry.md`` (its PromQL
table is ``telemetry/catalogue.py``'s).

Each figure is a function of a :class:`Scope`: the rate window, the label
matchers and the labels kept. The dashboard renders with ``$__rate_interval``
and ``{model=~"$model", instance=~"$instance"}``, the recording rules with
``[5m]`` and ``by (model)``, ``look`` with a window such as ``1m`` and no
matchers. A ratio is always ``sum(rate(num)) / sum(rate(den))``: numerator and
denominator are summed over replicas before dividing, which is exact across
replicas (a mean of per-replica ratios is not). Macro averages are ``_sum /
_count`` of the per-request histograms, counters too.

Series read: the service's (``telemetry/acceptance.py``: ``rollout_requests_total``,
``rollout_spec_decode_*``; ``telemetry/weights.py``: ``rollout_weight_*``; ``telemetry/drafter.py``:
``rollout_trainer_mtp_accuracy``; ``telemetry/speculation.py``: ``rollout_speculation_*``;
labels ``model``, ``engine``, and ``category`` on the acceptance series), vLLM's own
(``vllm:*``, whose model label is ``model_name``, so only ``instance`` selects them), and
Prometheus's ``up``; every series has the ``instance`` label Prometheus adds.
"""

from __future__ import annotations

from dataclasses import dataclass

REQUESTS = "rollout_requests_total"
NO_SPEC_REQUESTS = "rollout_spec_decode_no_spec_requests_total"
MISSING_STATS_REQUESTS = "rollout_spec_decode_missing_stats_requests_total"
INVALID_STATS_REQUESTS = "rollout_spec_decode_invalid_stats_requests_total"
DRAFTS = "rollout_spec_decode_drafts_total"
DRAFTS_WITH_POSITIONS = "rollout_spec_decode_drafts_with_positions_total"
"""Drafts of the requests that reported per-position acceptance."""
DRAFT_TOKENS = "rollout_spec_decode_draft_tokens_total"
ACCEPTED_TOKENS = "rollout_spec_decode_accepted_tokens_total"
REJECTED_TOKENS = "rollout_spec_decode_rejected_tokens_total"
COSTED_DRAFTS = "rollout_spec_decode_costed_drafts_total"
"""Drafts of the sequences with a verify cost ratio."""
COSTED_TOKENS = "rollout_spec_decode_costed_tokens_total"
"""Tokens those drafts' verify steps emitted (accepted drafts plus one each)."""
VERIFY_COST = "rollout_spec_decode_verify_cost_total"
"""Those verify steps, each at its sequence's verify cost ratio (in plain decode steps)."""
ACCEPTED_PER_POSITION = "rollout_spec_decode_accepted_per_position_total"
REQUEST_ACCEPT_RATE = "rollout_spec_decode_request_accept_rate"
"""Histogram: ``_sum``, ``_count``, ``_bucket``."""
REQUEST_ACCEPT_LENGTH = "rollout_spec_decode_request_accept_length"
"""Histogram: ``_sum``, ``_count``, ``_bucket``."""
WEIGHTS_DRAFTS = "rollout_spec_decode_weights_drafts"
"""Gauge: drafts on the ``current`` weights (since the last push) and the ``previous`` ones,
each labelled with its ``version``."""
WEIGHTS_ACCEPTED = "rollout_spec_decode_weights_accepted_per_position"
"""Gauge: per ``position``, beside :data:`WEIGHTS_DRAFTS`."""
TRAINER_ACCURACY = "rollout_trainer_mtp_accuracy"
"""Gauge: the trainer's top-1 accuracy of the MTP head, per ``version`` and ``position``."""
WEIGHT_VERSION = "rollout_weight_version"
WEIGHT_PUSHES = "rollout_weight_pushes_total"
PUSH_DURATION = "rollout_weight_push_duration_seconds"
"""Histogram: ``_sum``, ``_count``, ``_bucket``."""
SPECULATION_K = "rollout_speculation_k"
"""Gauge per ``bucket`` (a batch-size bucket's upper edge)."""
SPECULATION_REASON = "rollout_speculation_reason"
"""Gauge per ``bucket`` and ``reason``: 1 for the bucket's reason, 0 for the others."""
SPECULATION_COLLAPSED = "rollout_speculation_collapsed"
VLLM_GENERATION_TOKENS = "vllm:generation_tokens_total"
VLLM_REQUEST_LATENCY = "vllm:e2e_request_latency_seconds"
"""vLLM's histogram; one engine request is one sequence."""
SCRAPE_JOB = "rollout"
"""The Prometheus job scraping the service (``deploy/prometheus/prometheus.yml``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Scope:
    """Where a query looks and which labels it keeps."""

    window: str
    """Range of ``rate``/``increase``: a duration (``5m``) or a Grafana variable."""
    model: str | None = None
    """Regex the ``model`` label must match; None matches all. vLLM's series have
    no ``model`` label and ignore it."""
    instance: str | None = None
    """Regex the ``instance`` label must match; None matches all."""
    by: tuple[str, ...] = ()
    """Labels kept when aggregating over replicas; empty aggregates all."""
    offset: str | None = None
    """Look back this far (``1h``) in range selectors; None is now."""


def selector(scope: Scope, *matchers: str, has_model: bool = True) -> str:
    parts = [f'model=~"{scope.model}"'] if scope.model is not None and has_model else []
    if scope.instance is not None:
        parts.append(f'instance=~"{scope.instance}"')
    parts.extend(matchers)
    return "{" + ", ".join(parts) + "}" if parts else ""


def _range(series: str, scope: Scope, *matchers: str, has_model: bool = True) -> str:
    offset = f" offset {scope.offset}" if scope.offset else ""
    return f"{series}{selector(scope, *matchers, has_model=has_model)}[{scope.window}]{offset}"


def aggregate(operator: str, expr: str, labels: tuple[str, ...]) -> str:
    return f"{operator} by ({', '.join(labels)}) ({expr})" if labels else f"{operator}({expr})"


def _sum_rate(series: str, scope: Scope, *matchers: str, keep: tuple[str, ...] = (),
              has_model: bool = True) -> str:
    rate = f"rate({_range(series, scope, *matchers, has_model=has_model)})"
    return aggregate("sum", rate, (*scope.by, *keep))


def _ratio(numerator: str, denominator: str, scope: Scope) -> str:
    return f"{_sum_rate(numerator, scope)} / {_sum_rate(denominator, scope)}"


# ---- acceptance -----------------------------------------------------------------------

def macro_accept_rate(scope: Scope) -> str:
    """Mean of the per-request accept rates over requests with drafts (what a trainer logs).

    Requests without drafts have no rate and are left out; :func:`verl_accept_rate`
    counts them as 0 instead.
    """
    return _ratio(f"{REQUEST_ACCEPT_RATE}_sum", f"{REQUEST_ACCEPT_RATE}_count", scope)


def verl_accept_rate(scope: Scope) -> str:
    """Macro accept rate as verl computes it: requests without drafts count as 0.

    The denominator is every request with stats: the accept-length histogram observes
    each one, so its ``_count`` equals the accept-rate ``_count`` plus
    ``rollout_spec_decode_no_spec_requests_total``.
    """
    return _ratio(f"{REQUEST_ACCEPT_RATE}_sum", f"{REQUEST_ACCEPT_LENGTH}_count", scope)


def micro_accept_rate(scope: Scope) -> str:
    """All accepted draft tokens / all drafted tokens (long answers dominate)."""
    return _ratio(ACCEPTED_TOKENS, DRAFT_TOKENS, scope)


def macro_accept_length(scope: Scope) -> str:
    """Mean of the per-request accept lengths (bonus token included) over requests with stats.

    A request without drafts counts 1.0 (verl counts it as 0), so this population is
    wider than the macro accept rate's.
    """
    return _ratio(f"{REQUEST_ACCEPT_LENGTH}_sum", f"{REQUEST_ACCEPT_LENGTH}_count", scope)


def micro_accept_length(scope: Scope) -> str:
    """1 + all accepted tokens / all drafts: tokens per verify step over all tokens."""
    return f"1 + {_ratio(ACCEPTED_TOKENS, DRAFTS, scope)}"


def macro_accept_rate_by_category(scope: Scope) -> str:
    """Macro accept rate per request ``category`` (bounded: the allow-list or the first
    categories seen, the rest ``other``, requests without one ``none``).

    A category without requests with drafts in the window has no value (not NaN).
    """
    rate = f"{REQUEST_ACCEPT_RATE}_sum"
    count = f"{REQUEST_ACCEPT_RATE}_count"
    return (f"{_sum_rate(rate, scope, keep=('category',))}"
            f" / ({_sum_rate(count, scope, keep=('category',))} > 0)")


def micro_accept_rate_by_category(scope: Scope) -> str:
    """Micro accept rate (accepted / drafted tokens) per request ``category``; a category
    without drafted tokens in the window has no value."""
    return (f"{_sum_rate(ACCEPTED_TOKENS, scope, keep=('category',))}"
            f" / ({_sum_rate(DRAFT_TOKENS, scope, keep=('category',))} > 0)")


def accept_rate_per_position(scope: Scope) -> str:
    """Share of drafts whose token at 0-based draft position ``position`` was accepted.

    Over the drafts of requests that reported per-position acceptance (SGLang drops it
    for an inconsistent histogram), not over all drafts.
    """
    return (f"{_sum_rate(ACCEPTED_PER_POSITION, scope, keep=('position',))}"
            f" / ignoring (position) group_left {_sum_rate(DRAFTS_WITH_POSITIONS, scope)}")


def accept_rate_distribution(scope: Scope) -> str:
    """Requests with drafts per accept-rate bucket ``le`` over the window (heatmap cells)."""
    increase = f"increase({_range(f'{REQUEST_ACCEPT_RATE}_bucket', scope)})"
    return aggregate("sum", increase, (*scope.by, "le"))


def share_without_drafts(scope: Scope) -> str:
    """Share of finished requests with stats but no drafted token (e.g. ``max_tokens=1``)."""
    return _ratio(NO_SPEC_REQUESTS, REQUESTS, scope)


def share_without_stats(scope: Scope) -> str:
    """Share of finished requests whose engine returned no speculative-decoding stats."""
    return _ratio(MISSING_STATS_REQUESTS, REQUESTS, scope)


def share_with_invalid_stats(scope: Scope) -> str:
    """Share of finished requests whose engine returned counts that contradict themselves."""
    return _ratio(INVALID_STATS_REQUESTS, REQUESTS, scope)


# ---- what speculation costs ------------------------------------------------------------

def accepted_tokens_per_s(scope: Scope) -> str:
    """Drafted tokens the target accepted, per second (work that paid off)."""
    return _sum_rate(ACCEPTED_TOKENS, scope)


def rejected_tokens_per_s(scope: Scope) -> str:
    """Drafted tokens the target rejected, per second (work computed and thrown away)."""
    return _sum_rate(REJECTED_TOKENS, scope)


def verify_cost_ratio(scope: Scope) -> str:
    """Mean cost of a verify step in plain decode steps over the window, each sequence's
    steps at the ratio of the K they ran (the speculation control's measured costs) or at
    the engine's start-up figure for k_max.

    A ratio of counters, not the start-up gauge: with the controller, K changes with the
    batch size, and so does what a verify step costs.
    """
    return _ratio(VERIFY_COST, COSTED_DRAFTS, scope)


def net_speedup(scope: Scope) -> str:
    """Estimated net speed-up of speculation: tokens emitted by verify steps over those
    steps' cost in plain decode steps, each at its sequence's verify cost ratio; below 1,
    speculation slows decoding down.

    Per step, not per request: every verify step counts alike, which is what the engine's
    time is spent on; both sides count only sequences with a ratio (equal to the micro
    accept length over the ratio where every step has the same one).
    """
    return _ratio(COSTED_TOKENS, VERIFY_COST, scope)


# ---- drafter health per weight version ------------------------------------------------

def acceptance_by_weights(scope: Scope) -> str:
    """Share of drafts accepted at each draft ``position`` on the weights served now
    (``weights="current"``) and before the last push (``previous``), each with its
    ``version``; no value before the weights have drafted.

    Totals of each version's sequences, not rates: the ratio is that version's acceptance,
    however long ago it was served.
    """
    keep = (*scope.by, "weights", "version")
    accepted = aggregate("sum", f"{WEIGHTS_ACCEPTED}{selector(scope)}", (*keep, "position"))
    drafts = aggregate("sum", f"{WEIGHTS_DRAFTS}{selector(scope)}", keep)
    return f"{accepted} / ignoring (position) group_left () ({drafts} > 0)"


def trainer_mtp_accuracy(scope: Scope) -> str:
    """The trainer's top-1 accuracy of the MTP head per weight ``version`` and draft
    ``position`` (depth ``position + 1``), on its training batch."""
    return aggregate("max", f"{TRAINER_ACCURACY}{selector(scope)}",
                      (*scope.by, "version", "position"))


# ---- weights --------------------------------------------------------------------------

def weight_version(scope: Scope) -> str:
    """Weight version served per ``role`` (``main``, ``draft``); -1 before the first push."""
    return aggregate("max", f"{WEIGHT_VERSION}{selector(scope)}", (*scope.by, "role"))


def drafter_version_lag(scope: Scope) -> str:
    """Versions the drafter is behind the main model (the most of any replica in the group)."""
    main = WEIGHT_VERSION + selector(scope, 'role="main"')
    draft = WEIGHT_VERSION + selector(scope, 'role="draft"')
    return aggregate("max", f"{main} - ignoring (role) {draft}", scope.by)


def push_duration_mean(scope: Scope) -> str:
    """Mean pause-to-resume time of completed weight pushes."""
    return _ratio(f"{PUSH_DURATION}_sum", f"{PUSH_DURATION}_count", scope)


def push_duration_quantile(scope: Scope, quantile: float) -> str:
    """A quantile of the pause-to-resume time of completed weight pushes (from the histogram).

    Args:
        scope: window, matchers and labels kept.
        quantile: in ``[0, 1]``, e.g. 0.95.
    """
    buckets = _sum_rate(f"{PUSH_DURATION}_bucket", scope, keep=("le",))
    return f"histogram_quantile({quantile}, {buckets})"


def push_outcomes_per_minute(scope: Scope) -> str:
    """Weight pushes per minute by ``outcome`` (loaded, aborted, rejected, failed)."""
    return f"60 * {_sum_rate(WEIGHT_PUSHES, scope, keep=('outcome',))}"


def loaded_pushes(scope: Scope) -> str:
    """Weight pushes loaded within the window."""
    loaded = _range(WEIGHT_PUSHES, scope, 'outcome="loaded"')
    return aggregate("sum", f"increase({loaded})", scope.by)


def unsuccessful_pushes(scope: Scope) -> str:
    """Weight pushes that ended aborted, rejected or failed within the window, by ``outcome``."""
    matcher = 'outcome=~"failed|aborted|rejected"'
    return aggregate("sum", f"increase({_range(WEIGHT_PUSHES, scope, matcher)})",
                      (*scope.by, "outcome"))


# ---- speculation control --------------------------------------------------------------

def speculation_k(scope: Scope) -> str:
    """Draft tokens K the engine runs per batch-size ``bucket`` (its upper edge: the bucket
    covers the batch sizes above the previous edge); the most of any replica in the group.

    Without the speculation controller every bucket shows vLLM's fixed K.
    """
    return aggregate("max", f"{SPECULATION_K}{selector(scope)}", (*scope.by, "bucket"))


def speculation_reason(scope: Scope) -> str:
    """Why each batch-size ``bucket`` runs its K: one series per bucket and ``reason`` in
    force (best expected throughput, hysteresis hold, acceptance collapsed, no cost data,
    step cost extrapolated, probing the drafter, pinned, controller off)."""
    reasons = aggregate("max", f"{SPECULATION_REASON}{selector(scope)}",
                         (*scope.by, "bucket", "reason"))
    return f"{reasons} == 1"


def speculation_collapsed(scope: Scope) -> str:
    """1 while the drafter's acceptance has collapsed on some replica of the group (its
    controller runs K = 0 at every batch size until a drafter push or a re-probe)."""
    return aggregate("max", f"{SPECULATION_COLLAPSED}{selector(scope)}", scope.by)


# ---- serving (vLLM's own series) ------------------------------------------------------

def generated_tokens_per_s(scope: Scope) -> str:
    """Tokens vLLM generated per second (speculative decoding raises it)."""
    return _sum_rate(VLLM_GENERATION_TOKENS, scope, has_model=False)


def request_latency_quantile(scope: Scope, quantile: float) -> str:
    """A quantile of vLLM's end-to-end request latency (one engine request = one sequence).

    Args:
        scope: window, matchers and labels kept.
        quantile: in ``[0, 1]``, e.g. 0.95.
    """
    buckets = _sum_rate(f"{VLLM_REQUEST_LATENCY}_bucket", scope, keep=("le",), has_model=False)
    return f"histogram_quantile({quantile}, {buckets})"
