"""``python -m bench.dialect_clients``: the command line, the service under test, the table.

Runs in the caller's terminal process. Starts the service (``--url`` or a
``rollout-service serve`` child on ``--model``), runs the chosen clients one after another
(each module's ``run``; a ``/resume`` between them, since a failed step may leave the
service paused), then prints the table, the upstream sources of each client, and with
``--markdown`` writes the table as Markdown. What the tool checks: the package's docstring.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from . import __doc__ as PACKAGE_DOC
from . import areal, nemo, skyrl, slime, vllm_bench
from .common import HTTP_TIMEOUT_S, Row, Target

Runner = Callable[[Target, str], Awaitable[list[Row]]]


def _areal(backend: str) -> Runner:
    def run(t: Target, mode: str) -> Awaitable[list[Row]]:
        return areal.run(t, mode, backend)
    return run


CLIENTS: dict[str, tuple[Runner, list[str]]] = {
    "vllm-bench": (vllm_bench.run, vllm_bench.SOURCES),
    "skyrl": (skyrl.run, skyrl.SOURCES),
    "areal-sglang": (_areal("sglang"), areal.SOURCES["sglang"]),
    "areal-vllm": (_areal("vllm"), areal.SOURCES["vllm"]),
    "slime": (slime.run, slime.SOURCES),
    "nemo-rl": (nemo.run, nemo.SOURCES),
}
"""Each client's name in ``--clients``: its runner and the upstream sources it cites."""


async def run_clients(t: Target, mode: str, clients: list[str]) -> list[Row]:
    rows: list[Row] = []
    for name in clients:
        rows += await CLIENTS[name][0](t, mode)
        # a failed step may leave the service paused: the next client starts it again
        with contextlib.suppress(httpx.HTTPError):
            await t.http.post(t.url + "/resume", headers=t.auth)
    return rows


@contextlib.asynccontextmanager
async def target(args: argparse.Namespace) -> AsyncIterator[Target]:
    """The service under test: ``--url``, or one started here."""
    limits = httpx.Limits(max_connections=32, max_keepalive_connections=8)
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT_S, limits=limits) as http:
        if args.url:
            url = args.url.rstrip("/")
            yield Target(url, await served_model(http, url, args.api_key), args.tokenizer,
                         args.api_key, args.long_tokens, http)
            return
        from rollout_service.config import load_config
        from rollout_service.tools.launch import ServiceProcess

        with tempfile.TemporaryDirectory(prefix="dialect-clients-") as scratch:
            config = Path(scratch) / "service.json"
            config.write_text(json.dumps({"model": args.model,
                                          "mtp": {"num_speculative_tokens": 2}}))
            tokenizer = args.tokenizer or load_config(config).resolve_model()[0]
            log = Path(scratch) / "service.log"
            with ServiceProcess(log, config=config) as proc:
                await asyncio.to_thread(proc.wait_healthy, 900.0)
                try:
                    yield Target(proc.url, await served_model(http, proc.url, None), tokenizer,
                                 None, args.long_tokens, http)
                finally:
                    if args.keep_log:
                        Path(args.keep_log).write_text(log.read_text(errors="replace"))


async def served_model(http: httpx.AsyncClient, url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    resp = await http.get(url + "/v1/models", headers=headers)
    resp.raise_for_status()
    return str(resp.json()["data"][0]["id"])


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out


def result_text(row: Row) -> str:
    if row.failures:
        return "\n".join(row.failures)
    if row.skipped:
        return f"skipped: {row.skipped}"
    return "ok"


def print_table(rows: list[Row], console: Console) -> None:
    table = Table(title="RL framework clients against the service", show_lines=True)
    for name in ("client", "dialect", "calls", "result"):
        table.add_column(name, overflow="fold")
    for row in rows:
        style = "red" if row.failures else ("yellow" if row.skipped else "green")
        table.add_row(row.label, row.dialect, "\n".join(row.calls) or "-",
                      f"[{style}]{result_text(row)}[/{style}]")
    console.print(table)


def markdown(rows: list[Row]) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| client | dialect | calls | result |", "| --- | --- | --- | --- |"]
    lines += [f"| {cell(r.label)} | {cell(r.dialect)} | {cell(chr(10).join(r.calls) or '-')} | "
              f"{cell(result_text(r))} |" for r in rows]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    names = ",".join(CLIENTS)
    parser = argparse.ArgumentParser(prog="python -m bench.dialect_clients",
                                     description=(PACKAGE_DOC or "").split("\n", 1)[0])
    parser.add_argument("--url", help="a running service (default: start one here)")
    parser.add_argument("--api-key", help="the service's api_key, for the data calls")
    parser.add_argument("--model", default="embedded:tiny",
                        help="the model of the service started here (default embedded:tiny)")
    parser.add_argument("--tokenizer", help=(
        "the checkpoint directory (vLLM's benchmark client, slime's GenerateState, SkyRL's "
        "trainer path); default: the started service's checkpoint"))
    parser.add_argument("--mode", choices=("auto", "real", "data"), default="auto",
                        help="the frameworks' own code, their payloads as data, or real "
                        "where it imports (default)")
    parser.add_argument("--clients", default=names, help=f"comma-separated subset of {names}")
    parser.add_argument("--long-tokens", type=int, default=1000, help=(
        "max tokens of the requests paused or aborted mid-generation (prompt plus these "
        "must fit the context)"))
    parser.add_argument("--markdown", help="also write the table as Markdown to this file")
    parser.add_argument("--keep-log", help="copy the started service's log here")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.clients.split(",")) - set(CLIENTS))
    if unknown:
        parser.error(f"--clients: unknown {unknown}")
    return args


async def main_async(args: argparse.Namespace) -> int:
    console = Console(width=None if sys.stdout.isatty() else 160)
    clients = args.clients.split(",")
    async with target(args) as t:
        console.print(f"service {t.url}, model {t.model}, commit {commit()}, mode {args.mode}, "
                      f"Python {sys.version.split()[0]}")
        rows = await run_clients(t, args.mode, clients)
    print_table(rows, console)
    console.print("Sources:")
    for name in clients:
        for source in CLIENTS[name][1]:
            console.print(f"  {name}: {source}", soft_wrap=True)
    if args.markdown:
        Path(args.markdown).write_text(markdown(rows))
    return 1 if any(r.failures for r in rows) else 0


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
