"""Every PromQL expression of the rollout service, written once.

Pure string rendering, no Prometheus client and no I/O. Read by the Grafana
dashboard (``deploy/grafana/dashboards.py``), the recording rules and alerts
(``deploy/prometheus/rules.py``), ``rollout-service look`` (range queries from
the operator's process) and ``docs/telemetry.md`` (its PromQL table is
:func:`markdown_table`; ``python -m rollout_service.telemetry.queries
docs/telemetry.md`` rewrites it).

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

import functools
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

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


def _selector(scope: Scope, *matchers: str, has_model: bool = True) -> str:
    parts = [f'model=~"{scope.model}"'] if scope.model is not None and has_model else []
    if scope.instance is not None:
        parts.append(f'instance=~"{scope.instance}"')
    parts.extend(matchers)
    return "{" + ", ".join(parts) + "}" if parts else ""


def _range(series: str, scope: Scope, *matchers: str, has_model: bool = True) -> str:
    offset = f" offset {scope.offset}" if scope.offset else ""
    return f"{series}{_selector(scope, *matchers, has_model=has_model)}[{scope.window}]{offset}"


def _aggregate(operator: str, expr: str, labels: tuple[str, ...]) -> str:
    return f"{operator} by ({', '.join(labels)}) ({expr})" if labels else f"{operator}({expr})"


def _sum_rate(series: str, scope: Scope, *matchers: str, keep: tuple[str, ...] = (),
              has_model: bool = True) -> str:
    rate = f"rate({_range(series, scope, *matchers, has_model=has_model)})"
    return _aggregate("sum", rate, (*scope.by, *keep))


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
    return _aggregate("sum", increase, (*scope.by, "le"))


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
    accepted = _aggregate("sum", f"{WEIGHTS_ACCEPTED}{_selector(scope)}", (*keep, "position"))
    drafts = _aggregate("sum", f"{WEIGHTS_DRAFTS}{_selector(scope)}", keep)
    return f"{accepted} / ignoring (position) group_left () ({drafts} > 0)"


def trainer_mtp_accuracy(scope: Scope) -> str:
    """The trainer's top-1 accuracy of the MTP head per weight ``version`` and draft
    ``position`` (depth ``position + 1``), on its training batch."""
    return _aggregate("max", f"{TRAINER_ACCURACY}{_selector(scope)}",
                      (*scope.by, "version", "position"))


def _position_zero_acceptance(scope: Scope) -> str:
    """Acceptance at draft position 0 per ``scope.by``, where those weights have at least
    :data:`MIN_DRAFTS` drafts (fewer: no value)."""
    accepted = _aggregate("sum", WEIGHTS_ACCEPTED + _selector(scope, 'position="0"'), scope.by)
    drafts = _aggregate("sum", WEIGHTS_DRAFTS + _selector(scope), scope.by)
    return f"{accepted} / ({drafts} >= {MIN_DRAFTS})"


# ---- weights --------------------------------------------------------------------------

def weight_version(scope: Scope) -> str:
    """Weight version served per ``role`` (``main``, ``draft``); -1 before the first push."""
    return _aggregate("max", f"{WEIGHT_VERSION}{_selector(scope)}", (*scope.by, "role"))


def drafter_version_lag(scope: Scope) -> str:
    """Versions the drafter is behind the main model (the most of any replica in the group)."""
    main = WEIGHT_VERSION + _selector(scope, 'role="main"')
    draft = WEIGHT_VERSION + _selector(scope, 'role="draft"')
    return _aggregate("max", f"{main} - ignoring (role) {draft}", scope.by)


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
    return _aggregate("sum", f"increase({loaded})", scope.by)


def unsuccessful_pushes(scope: Scope) -> str:
    """Weight pushes that ended aborted, rejected or failed within the window, by ``outcome``."""
    matcher = 'outcome=~"failed|aborted|rejected"'
    return _aggregate("sum", f"increase({_range(WEIGHT_PUSHES, scope, matcher)})",
                      (*scope.by, "outcome"))


# ---- speculation control --------------------------------------------------------------

def speculation_k(scope: Scope) -> str:
    """Draft tokens K the engine runs per batch-size ``bucket`` (its upper edge: the bucket
    covers the batch sizes above the previous edge); the most of any replica in the group.

    Without the speculation controller every bucket shows vLLM's fixed K.
    """
    return _aggregate("max", f"{SPECULATION_K}{_selector(scope)}", (*scope.by, "bucket"))


def speculation_reason(scope: Scope) -> str:
    """Why each batch-size ``bucket`` runs its K: one series per bucket and ``reason`` in
    force (best expected throughput, hysteresis hold, acceptance collapsed, no cost data,
    probing the drafter, pinned, controller off)."""
    reasons = _aggregate("max", f"{SPECULATION_REASON}{_selector(scope)}",
                         (*scope.by, "bucket", "reason"))
    return f"{reasons} == 1"


def speculation_collapsed(scope: Scope) -> str:
    """1 while the drafter's acceptance has collapsed on some replica of the group (its
    controller runs K = 0 at every batch size until a drafter push or a re-probe)."""
    return _aggregate("max", f"{SPECULATION_COLLAPSED}{_selector(scope)}", scope.by)


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


# ---- alerts ---------------------------------------------------------------------------

ALERT_WINDOW = "5m"
"""Rate window of the acceptance alerts, as the recording rules'."""
PUSH_WINDOW = "15m"
"""Weight pushes come once per training step, minutes apart: a window of a few
scrapes would mostly hold none."""
ACCEPT_RATE_DROP_FACTOR = 0.5
"""The drop alert: acceptance after a push below this fraction of the one before."""
TRAINING_GAP_FACTOR = 0.5
"""Rollout acceptance below this fraction of the trainer's accuracy for the same version."""
MIN_DRAFTS = 64
"""Drafts a weight version needs before its acceptance is compared (a few requests)."""
BASELINE_WINDOW = "15m"
BASELINE_STEP = "15s"
"""The drop alert's memory of the level before the push: a subquery over this window."""
SLOW_PUSH_S = 30
PER_MODEL = ("model",)
PER_INSTANCE = ("model", "instance")


def alert_accept_rate_dropped_after_push() -> str:
    """Acceptance at the first draft position of the weights served now or before the last
    push (each over at least 64 drafts) fell below half the best such level of the last 15
    minutes: a push broke the drafter, or left it behind the policy.

    Both weights and a 15-minute memory: pushes come every step, so the weights before the
    last push are often already broken ones, and the weights just pushed have not drafted
    yet; the condition holds for as long as the broken drafter is served (15 minutes at
    most: then the rollout-versus-training alert, and the slow-down one, still hold).
    """
    per_weights = Scope(window=ALERT_WINDOW, by=(*PER_MODEL, "weights"))
    recent = _aggregate("min", _position_zero_acceptance(per_weights), PER_MODEL)
    best = _aggregate("max", _position_zero_acceptance(per_weights), PER_MODEL)
    baseline = f"max_over_time(({best})[{BASELINE_WINDOW}:{BASELINE_STEP}])"
    return f"{recent} < {ACCEPT_RATE_DROP_FACTOR} * {baseline}"


def alert_acceptance_below_training_accuracy() -> str:
    """Rollout acceptance at the first draft position of a weight version (over at least 64
    drafts) is below half the trainer's top-1 accuracy of the MTP head for the same version:
    the drafter the engine runs is not the drafter the trainer trained. The value is the
    lowest ratio of the two over the versions exported (the weights now and before the
    last push)."""
    per_version = Scope(window=ALERT_WINDOW, by=(*PER_MODEL, "version"))
    accuracy = _aggregate("max", f'{TRAINER_ACCURACY}{{position="0"}}', per_version.by)
    ratio = f"{_position_zero_acceptance(per_version)} / on (model, version) {accuracy}"
    return f"{_aggregate('min', ratio, PER_MODEL)} < {TRAINING_GAP_FACTOR}"


def alert_drafter_behind_main() -> str:
    """A replica's drafter serves an older weight version than its main model."""
    return f"{drafter_version_lag(Scope(window=ALERT_WINDOW, by=PER_INSTANCE))} > 0"


def alert_push_unsuccessful() -> str:
    """A weight push ended aborted, rejected or failed in the last 15m."""
    return f"{unsuccessful_pushes(Scope(window=PUSH_WINDOW, by=PER_INSTANCE))} > 0"


def alert_push_slow() -> str:
    """Completed weight pushes took more than 30 s on average over 15m."""
    return f"{push_duration_mean(Scope(window=PUSH_WINDOW, by=PER_INSTANCE))} > {SLOW_PUSH_S}"


def alert_stats_missing() -> str:
    """Requests finish without per-request speculative-decoding stats."""
    return f"{share_without_stats(Scope(window=ALERT_WINDOW, by=PER_INSTANCE))} > 0"


def alert_speculation_slowdown() -> str:
    """The estimated net speed-up of speculation is below 1: drafting and verifying cost
    more than the accepted tokens save, each verify step priced at the K it ran where the
    speculation control measured it."""
    return f"{net_speedup(Scope(window=ALERT_WINDOW, by=PER_INSTANCE))} < 1"


def alert_service_down() -> str:
    """Prometheus cannot scrape a replica's ``/metrics``."""
    return f'up{{job="{SCRAPE_JOB}"}} == 0'


# ---- the catalogue: docs table and tests ----------------------------------------------

@dataclass(frozen=True, kw_only=True, slots=True)
class Figure:
    """A named figure for the docs table and the tests; its meaning is the first line
    of its query function's docstring."""

    name: str
    unit: str
    query: Callable[[Scope], str]

    @property
    def meaning(self) -> str:
        func = self.query.func if isinstance(self.query, functools.partial) else self.query
        return " ".join(inspect.getdoc(func).split("\n\n")[0].split())


FIGURES = (
    Figure(name="macro accept rate", unit="ratio", query=macro_accept_rate),
    Figure(name="verl's accept rate", unit="ratio", query=verl_accept_rate),
    Figure(name="micro accept rate", unit="ratio", query=micro_accept_rate),
    Figure(name="macro accept length", unit="tokens / verify step", query=macro_accept_length),
    Figure(name="micro accept length", unit="tokens / verify step", query=micro_accept_length),
    Figure(name="per-position acceptance", unit="ratio", query=accept_rate_per_position),
    Figure(name="macro accept rate by category", unit="ratio",
           query=macro_accept_rate_by_category),
    Figure(name="micro accept rate by category", unit="ratio",
           query=micro_accept_rate_by_category),
    Figure(name="accept-rate distribution", unit="requests",
           query=accept_rate_distribution),
    Figure(name="share without drafts", unit="ratio", query=share_without_drafts),
    Figure(name="share without stats", unit="ratio", query=share_without_stats),
    Figure(name="share with invalid stats", unit="ratio", query=share_with_invalid_stats),
    Figure(name="accepted draft tokens/s", unit="tokens / s", query=accepted_tokens_per_s),
    Figure(name="rejected draft tokens/s", unit="tokens / s", query=rejected_tokens_per_s),
    Figure(name="verify cost ratio", unit="plain decode steps", query=verify_cost_ratio),
    Figure(name="net speed-up", unit="ratio", query=net_speedup),
    Figure(name="acceptance by weights", unit="ratio", query=acceptance_by_weights),
    Figure(name="trainer MTP accuracy", unit="ratio", query=trainer_mtp_accuracy),
    Figure(name="weight version", unit="version", query=weight_version),
    Figure(name="drafter version lag", unit="versions", query=drafter_version_lag),
    Figure(name="mean push duration", unit="s", query=push_duration_mean),
    Figure(name="p95 push duration", unit="s",
           query=functools.partial(push_duration_quantile, quantile=0.95)),
    Figure(name="push outcomes", unit="pushes / min", query=push_outcomes_per_minute),
    Figure(name="loaded pushes", unit="pushes", query=loaded_pushes),
    Figure(name="unsuccessful pushes", unit="pushes", query=unsuccessful_pushes),
    Figure(name="K in force per bucket", unit="draft tokens", query=speculation_k),
    Figure(name="reason per bucket", unit="1", query=speculation_reason),
    Figure(name="acceptance collapsed", unit="0/1", query=speculation_collapsed),
    Figure(name="generated tokens/s", unit="tokens / s", query=generated_tokens_per_s),
    Figure(name="p95 request latency", unit="s",
           query=functools.partial(request_latency_quantile, quantile=0.95)),
)
"""Every figure; the docs table lists them and the integration tests evaluate each."""

ALERTS = (alert_accept_rate_dropped_after_push, alert_acceptance_below_training_accuracy,
          alert_drafter_behind_main,
          alert_push_unsuccessful, alert_push_slow, alert_stats_missing,
          alert_speculation_slowdown, alert_service_down)
"""Every alert condition (``deploy/prometheus/rules.py`` names and annotates them)."""

DOCS_SCOPE = Scope(window="5m")
"""The docs show each figure over 5m, summed over every replica."""
TABLE_BEGIN = "<!-- PromQL table: generated by rollout_service/telemetry/queries.py -->"
TABLE_END = "<!-- end of the generated PromQL table -->"


def markdown_table(scope: Scope = DOCS_SCOPE) -> str:
    """Every figure and alert condition as one markdown table (``docs/telemetry.md``)."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    rows = ["| figure | unit | meaning | PromQL |", "| --- | --- | --- | --- |"]
    rows += [f"| {f.name} | {f.unit} | {cell(f.meaning)} | `{cell(f.query(scope))}` |"
             for f in FIGURES]
    rows += [f"| alert: {a.__name__.removeprefix('alert_').replace('_', ' ')} | | "
             f"{cell(' '.join(inspect.getdoc(a).split()))} | `{cell(a())}` |" for a in ALERTS]
    return "\n".join(rows) + "\n"


def replace_table(text: str) -> str:
    """``text`` with the lines between :data:`TABLE_BEGIN` and :data:`TABLE_END` replaced
    by :func:`markdown_table`.

    Raises:
        ValueError: the markers are missing or out of order.
    """
    head, begin, rest = text.partition(TABLE_BEGIN + "\n")
    _, end, tail = rest.partition(TABLE_END)
    if not begin or not end:
        raise ValueError(f"expected {TABLE_BEGIN!r} and then {TABLE_END!r} on their own lines")
    return f"{head}{begin}{markdown_table()}{end}{tail}"


def main() -> None:
    """``python -m rollout_service.telemetry.queries [DOC.md]``: print the table, or
    rewrite it in DOC.md."""
    if len(sys.argv) < 2:
        print(markdown_table(), end="")
        return
    path = Path(sys.argv[1])
    path.write_text(replace_table(path.read_text()))
    print(f"wrote the PromQL table of {path}")


if __name__ == "__main__":
    main()
