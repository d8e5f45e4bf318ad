"""The README and the topic pages under ``docs/`` say only what runs.

Runs in the pytest process. Every ```python block of a page runs, in page order
and in one namespace per page (a later block may use an earlier one's names),
unless the line before it is ``<!-- not run: reason -->``; blocks that read
``ROLLOUT_URL``, ``ROLLOUT_API_KEY`` or ``ROLLOUT_WEIGHTS_TOKEN`` get the
session's service (real vLLM CPU engine, ``conftest.service``) through those
environment variables. Every ```yaml block with a ``model`` key validates as a
service config (``RayServeConfig`` on the Ray Serve page). Relative links
resolve, and PromQL appears only on the telemetry page, which owns the one
table of it.

    .venv/bin/python -m pytest -q tests/integration/test_docs.py -p no:cacheprovider
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.integration.conftest import API_KEY, WEIGHTS_TOKEN

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TELEMETRY_PAGE = ROOT / "docs" / "telemetry.md"
RAY_SERVE_PAGE = ROOT / "docs" / "ray-serve.md"

MAX_README_LINES = 150
"""The README is a front page; everything else goes to a topic page."""
MAX_NOT_RUN = 4
"""Samples that cannot run here (GPU, a Megatron model) stay few."""

NOT_RUN = re.compile(r"^\s*<!--\s*not run:\s*(?P<reason>\S.*?)\s*-->\s*$")
OPENING_FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w-]*)\s*$")
LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")
PROMQL = re.compile(r"\b(?:rate|irate|increase|histogram_quantile)\(")
SERVICE_ENV = ("ROLLOUT_URL", "ROLLOUT_API_KEY", "ROLLOUT_WEIGHTS_TOKEN")


@dataclass(frozen=True, kw_only=True, slots=True)
class Block:
    """One fenced code block of a page."""

    page: Path
    line: int
    """1-based line of the block's first code line."""
    lang: str
    source: str
    not_run: str | None
    """Why it does not run (the marker's reason); None when it runs."""

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def code_blocks(page: Path) -> list[Block]:
    """Every fenced block of ``page``, with the not-run marker of the line before it."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = OPENING_FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        closing = f"{opening['indent']}```"
        end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == closing), None)
        assert end is not None, f"{page.relative_to(ROOT)}:{i + 1}: code block never closed"
        marker = NOT_RUN.match(lines[i - 1]) if i > 0 else None
        blocks.append(Block(page=page, line=i + 2, lang=opening["lang"],
                            source=textwrap.dedent("\n".join(lines[i + 1:end])),
                            not_run=marker["reason"] if marker else None))
        i = end + 1
    return blocks


def python_blocks(page: Path) -> list[Block]:
    return [b for b in code_blocks(page) if b.lang == "python"]


PYTHON_PAGES = [page for page in PAGES if python_blocks(page)]


@pytest.mark.parametrize("page", PYTHON_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_samples_run(page: Path, request: pytest.FixtureRequest,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    runnable = [b for b in python_blocks(page) if b.not_run is None]
    if any(name in b.source for b in runnable for name in SERVICE_ENV):
        pytest.importorskip("vllm", reason="the samples talk to the service (vLLM engine)")
        service = request.getfixturevalue("service")
        monkeypatch.setenv("ROLLOUT_URL", service.url)
        monkeypatch.setenv("ROLLOUT_API_KEY", API_KEY)
        monkeypatch.setenv("ROLLOUT_WEIGHTS_TOKEN", WEIGHTS_TOKEN)
    namespace: dict[str, object] = {"__name__": "__docs__"}
    for block in runnable:
        # Padding keeps the page's line numbers in tracebacks.
        code = compile("\n" * (block.line - 1) + block.source,
                       str(block.page.relative_to(ROOT)), "exec")
        exec(code, namespace)  # noqa: S102 - the samples are this repository's own text


def test_not_run_markers_say_why_and_stay_few() -> None:
    marked = [b for page in PAGES for b in python_blocks(page) if b.not_run is not None]
    assert len(marked) <= MAX_NOT_RUN, (
        f"{len(marked)} samples do not run (at most {MAX_NOT_RUN}): "
        + ", ".join(b.where for b in marked))
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        num_markers = sum(line.lstrip().startswith("<!-- not run") for line in lines)
        num_marked = sum(b.not_run is not None for b in python_blocks(page))
        assert num_markers == num_marked, (
            f"{page.relative_to(ROOT)}: a '<!-- not run: reason -->' marker must be the line "
            "right before a ```python block and give a reason")


def test_config_samples_validate() -> None:
    from rollout_service.config import ServiceConfig
    from rollout_service.serve.config import RayServeConfig

    checked = 0
    for page in PAGES:
        config_type = RayServeConfig if page == RAY_SERVE_PAGE else ServiceConfig
        for block in code_blocks(page):
            data = yaml.safe_load(block.source) if block.lang == "yaml" else None
            if isinstance(data, dict) and "model" in data:
                try:
                    config_type.model_validate(data)
                except ValueError as exc:
                    pytest.fail(f"{block.where}: not a valid {config_type.__name__}: {exc}")
                checked += 1
    assert checked, "no config sample found: the README shows one"


def test_relative_links_resolve() -> None:
    broken = []
    for page in PAGES:
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1):
            for match in LINK.finditer(line):
                target = match["target"].split("#")[0]
                if target and "://" not in target and not (page.parent / target).exists():
                    broken.append(f"{page.relative_to(ROOT)}:{number}: {match['target']}")
    assert not broken, "links to missing files:\n" + "\n".join(broken)


def test_promql_lives_only_on_the_telemetry_page() -> None:
    found = [f"{page.relative_to(ROOT)}:{number}: {line.strip()}"
             for page in PAGES if page != TELEMETRY_PAGE
             for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(),
                                           start=1)
             if PROMQL.search(line)]
    assert not found, ("PromQL outside docs/telemetry.md (link to its table instead):\n"
                       + "\n".join(found))


def test_readme_is_a_front_page() -> None:
    num_lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert num_lines <= MAX_README_LINES, (
        f"README.md has {num_lines} lines (at most {MAX_README_LINES}): move detail to docs/")
