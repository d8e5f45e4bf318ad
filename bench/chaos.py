"""Chaos runs of drafter health: break the drafter, or its stats, inside a real RL loop, and
time the alert that a real Prometheus raises from the project's own rules.

Runs in the caller's process, which plays the trainer: the RL loop's own steps
(``trainer_client.loop``: generate -> pack -> megatron-core forward/backward with the
policy and MTP losses -> Adam -> push, with the MTP head's top-1 accuracy as the push's
training stats), on CPU. It starts one rollout service (``rollout-service serve``
through ``tests/support/fake_stats_outage.py``, which can switch per-request stats off) on
a tiny MiMo checkpoint generated with ``--draft-noise`` (the embedded generator's knob for
the drafter's accuracy, so a healthy drafter is accepted about as often as a trained one)
and one Prometheus that scrapes it every second and evaluates
``deploy/prometheus/rules.py``'s rules with every alert's ``for`` shortened to ``--for``:
the expressions are exactly the committed ones, only the waiting differs.

The cases run one after another on that service, each from a healthy state in which no
alert is pending or firing:

- ``control``: healthy steps (pushes of main and drafter); every alert that fires is a
  false alarm;
- ``drafter_push_skipped``: the trainer keeps training but pushes the main model only;
- ``drafter_zeroed``: a push whose MTP-layer tensors are all zeros;
- ``eh_proj_swapped``: a converter bug, the two halves of the MTP layer's input projection
  (MiMo's ``input_proj``, DeepSeek's ``eh_proj``: ``[hidden | embedding]``) swapped in the
  exported drafter;
- ``stats_outage``: the engine stops reporting per-request stats (a FAKE switch, see its
  module); last, because the missing-stats alert's 5m window keeps it firing afterwards.

The clock of a case starts when its fault is in effect (the broken push loaded, or the
switch flipped), and the requests are counted from there; the fault runs until the
case's alert fires, or 60 s, or 256 requests, whichever comes first. A case passes when
its alert fired within those limits. Between cases healthy steps restore the drafter
until no alert is active.

This module is the command line and the table; the cases are in ``bench/chaos_cases.py``,
the service, Prometheus and trainer that run them in ``bench/chaos_runner.py``.

    python -m bench.chaos                      # every case, then the table
    python -m bench.chaos --cases control,drafter_zeroed --for 5s
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.chaos_cases import CASES, CaseResult
from bench.chaos_runner import ChaosConfig, run_chaos


def table(results: list[CaseResult], config: ChaosConfig) -> Table:
    out = Table("case", "alert", "fired after (s)", "requests", "other alerts fired",
                "macro accept rate", "net speed-up", title=(
                    f"chaos: alert within {config.max_seconds:g} s or {config.max_requests} "
                    f"requests; rules' for: {config.for_s}"))
    for r in results:
        out.add_row(
            r.case.name, r.case.alert or "(none expected)",
            "-" if r.fired_after_s is None else f"{r.fired_after_s:.1f}",
            "-" if r.fired_after_requests is None else str(r.fired_after_requests),
            ", ".join(r.other_alerts) or ("none: no false alarm" if r.case.alert is None
                                          else "none"),
            f"{r.figures.get('macro accept rate (1m)', float('nan')):.2f}",
            f"{r.figures.get('net speed-up (1m)', float('nan')):.2f}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(c.name for c in CASES))
    defaults = {f.name: f.default for f in dataclasses.fields(ChaosConfig)}
    parser.add_argument("--draft-noise", type=float, default=defaults["draft_noise"])
    parser.add_argument("--for", dest="for_s", default=defaults["for_s"])
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    names = args.cases.split(",")
    unknown = set(names) - {c.name for c in CASES}
    if unknown:
        parser.error(f"--cases: unknown {sorted(unknown)}")
    with tempfile.TemporaryDirectory(prefix="chaos-") as tmp:
        config = ChaosConfig(workdir=args.workdir or Path(tmp), draft_noise=args.draft_noise,
                             for_s=args.for_s)
        results = run_chaos(config, tuple(c for c in CASES if c.name in names))
    Console(width=200).print(table(results, config))
    raise SystemExit(0 if all(r.passed for r in results) else 1)


if __name__ == "__main__":
    main()
