"""The alert conditions of the rollout service: PromQL over :mod:`queries`' figures.

Pure string rendering, like :mod:`rollout_service.telemetry.queries`, whose figures these
compare against thresholds. ``deploy/prometheus/rules.py`` names, times and annotates
them; ``telemetry/catalogue.py`` lists them in the docs table; the integration tests
fire each against a real Prometheus.
"""

from __future__ import annotations

from rollout_service.telemetry.queries import (
    SCRAPE_JOB,
    TRAINER_ACCURACY,
    WEIGHTS_ACCEPTED,
    WEIGHTS_DRAFTS,
    Scope,
    aggregate,
    drafter_version_lag,
    net_speedup,
    push_duration_mean,
    selector,
    share_without_stats,
    unsuccessful_pushes,
)

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
    recent = aggregate("min", position_zero_acceptance(per_weights), PER_MODEL)
    best = aggregate("max", position_zero_acceptance(per_weights), PER_MODEL)
    baseline = f"max_over_time(({best})[{BASELINE_WINDOW}:{BASELINE_STEP}])"
    return f"{recent} < {ACCEPT_RATE_DROP_FACTOR} * {baseline}"


def alert_acceptance_below_training_accuracy() -> str:
    """Rollout acceptance at the first draft position of a weight version (over at least 64
    drafts) is below half the trainer's top-1 accuracy of the MTP head for the same version:
    the drafter the engine runs is not the drafter the trainer trained. The value is the
    lowest ratio of the two over the versions exported (the weights now and before the
    last push)."""
    per_version = Scope(window=ALERT_WINDOW, by=(*PER_MODEL, "version"))
    accuracy = aggregate("max", f'{TRAINER_ACCURACY}{{position="0"}}', per_version.by)
    ratio = f"{position_zero_acceptance(per_version)} / on (model, version) {accuracy}"
    return f"{aggregate('min', ratio, PER_MODEL)} < {TRAINING_GAP_FACTOR}"


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


def position_zero_acceptance(scope: Scope) -> str:
    """Acceptance at draft position 0 per ``scope.by``, where those weights have at least
    :data:`MIN_DRAFTS` drafts (fewer: no value)."""
    accepted = aggregate("sum", WEIGHTS_ACCEPTED + selector(scope, 'position="0"'), scope.by)
    drafts = aggregate("sum", WEIGHTS_DRAFTS + selector(scope), scope.by)
    return f"{accepted} / ({drafts} >= {MIN_DRAFTS})"


ALERTS = (alert_accept_rate_dropped_after_push, alert_acceptance_below_training_accuracy,
          alert_drafter_behind_main,
          alert_push_unsuccessful, alert_push_slow, alert_stats_missing,
          alert_speculation_slowdown, alert_service_down)
"""Every alert condition (``deploy/prometheus/rules.py`` names and annotates them)."""
