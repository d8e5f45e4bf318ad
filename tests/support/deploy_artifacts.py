"""The deploy artifacts as tests read them, and the PromQL parsing the tests need.

Runs in the test process (imported by tests/integration/test_deploy_artifacts.py,
test_deploy_live.py and test_deploy_serve.py). Reads ``deploy/prometheus/rules.yml``
(recording rules and alerts) and ``deploy/grafana/dashboards/rollout.json`` (every
``expr``, its template variables); splits an expression at top-level operators,
expands recorded series into their expressions (the test Prometheus has no rules) and
lists the metric names an expression reads.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_YML = ROOT / "deploy" / "prometheus" / "prometheus.yml"
RULES_YML = ROOT / "deploy" / "prometheus" / "rules.yml"
DASHBOARD_JSON = ROOT / "deploy" / "grafana" / "dashboards" / "rollout.json"
WINDOW = "1m"
"""What Grafana's ``$__rate_interval`` and ``$__interval`` stand for here."""
DASHBOARD_VARIABLES = {"$__rate_interval": WINDOW, "$__interval": WINDOW,
                       "$model": ".*", "$instance": ".*"}
GROUPING = r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)"
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool",
            "and", "or", "unless", "inf", "nan"}
COMPARISON = re.compile(  # a top-level comparison or set operator and its modifiers
    r"(?:==|!=|>=|<=|>|<|\b(?:and|or|unless)\b)(?:\s*bool)?"
    r"(?:\s*\b(?:on|ignoring)\s*\x00+)?(?:\s*\b(?:group_left|group_right)\b(?:\s*\x00+)?)?")
DIVISION = re.compile(
    r"/(?:\s*\b(?:on|ignoring)\s*\x00+)?(?:\s*\b(?:group_left|group_right)\b(?:\s*\x00+)?)?")
PLUS = re.compile(r"\+")


def _rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES_YML.read_text())["groups"]
            for rule in group["rules"]]


def _recorded() -> dict[str, str]:
    return {r["record"]: r["expr"] for r in _rules() if "record" in r}


def _alerts() -> dict[str, str]:
    return {r["alert"]: r["expr"] for r in _rules() if "alert" in r}


def _dashboard() -> dict:
    return json.loads(DASHBOARD_JSON.read_text())


def _dashboard_exprs() -> list[str]:
    """Every ``expr`` anywhere in the dashboard (panel targets, annotations)."""
    found: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                found.append(node["expr"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(_dashboard())
    return found


def _substitute(expr: str) -> str:
    for name in sorted(DASHBOARD_VARIABLES, key=len, reverse=True):
        expr = expr.replace(name, DASHBOARD_VARIABLES[name])
    assert "$" not in expr, f"unknown dashboard variable in {expr!r}"
    return expr


def _split_top(expr: str, operator: re.Pattern[str]) -> list[str]:
    """Split ``expr`` at ``operator`` outside brackets and strings."""
    flat, depth, quote = [], 0, None
    for ch in expr:
        if quote:
            quote = None if ch == quote else quote
            flat.append("\x00")
        elif ch in "\"'`":
            quote = ch
            flat.append("\x00")
        else:
            depth += (ch in "([{") - (ch in ")]}")
            flat.append(ch if depth == 0 and ch not in ")]}" else "\x00")
    parts, start = [], 0
    for match in operator.finditer("".join(flat)):
        parts.append(expr[start:match.start()].strip())
        start = match.end()
    return [*parts, expr[start:].strip()]


def _expand_recorded(expr: str) -> str:
    """Replace recorded series by their expressions (the test Prometheus has no rules)."""
    for name, recorded in _recorded().items():
        expr = re.sub(rf"(?<![\w:]){re.escape(name)}(?![\w:])", f"({recorded})", expr)
    return expr


def _metric_names(expr: str) -> set[str]:
    text = re.sub(r'"(?:\\.|[^"\\])*"', "", expr)
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", text)
    text = re.sub(GROUPING, " ", text)
    names = re.findall(r"(?<![\w:.])([A-Za-z_:][\w:]*)(?![\w:]|\s*\()", text)
    return {n for n in names if n not in KEYWORDS}
