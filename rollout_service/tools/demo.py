"""``rollout-service demo``: start the service, roll out a batch, show acceptance.

Runs in the user's terminal process; the service runs as a child process
(``ServiceProcess``) and is reached over HTTP exactly as a trainer reaches it.
Prints each request's acceptance as it finishes, then the batch's macro and
micro averages, computed twice: from the responses, and from the service's
Prometheus histograms (``_sum / _count``), which must agree.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
from rich.table import Table

from rollout_service.client import RolloutClient
from rollout_service.embedded.corpus import arithmetic_prompts
from rollout_service.protocol import messages
from rollout_service.protocol.acceptance import summarize
from rollout_service.tools.launch import ServiceProcess
from rollout_service.tools.scrape import histogram_mean


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


async def _rollout(url: str, prompts: list[str], max_tokens: int, temperature: float,
                   console: Console) -> list[messages.GenerateResponse]:
    table = Table("#", "prompt", "tokens", "drafts", "accepted", "accept rate", "accept len")
    table.columns[1].no_wrap = True
    async with RolloutClient(url) as client:
        columns = (*Progress.get_default_columns()[:1], BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn())
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("rolling out", total=len(prompts))

            async def one(i: int, prompt: str) -> messages.GenerateResponse:
                response = await client.generate(messages.GenerateRequest(
                    prompt=prompt, max_tokens=max_tokens, temperature=temperature, seed=i))
                progress.advance(task)
                return response

            responses = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        for i, (prompt, response) in enumerate(zip(prompts, responses)):
            out = response.outputs[0]
            spec = out.spec_decode
            table.add_row(str(i), prompt.strip(), str(len(out.token_ids)),
                          str(spec.num_draft_tokens if spec else "-"),
                          str(spec.num_accepted_tokens if spec else "-"),
                          _fmt(spec.accept_rate if spec else None),
                          _fmt(spec.accept_length if spec else None))
        console.print(table)
        metrics_text = await client.metrics_text()
    _print_summary(console, responses, metrics_text)
    return list(responses)


def _print_summary(console: Console, responses: list[messages.GenerateResponse],
                   metrics_text: str) -> None:
    summary = summarize(None if o.spec_decode is None else o.spec_decode.to_stats()
                        for r in responses for o in r.outputs)
    table = Table("figure", "from responses", "from Prometheus (_sum/_count)")
    table.add_row("macro accept rate", _fmt(summary.macro_accept_rate),
                  _fmt(histogram_mean(metrics_text, "rollout_spec_decode_request_accept_rate")))
    table.add_row("macro accept length", _fmt(summary.macro_accept_length),
                  _fmt(histogram_mean(metrics_text,
                                        "rollout_spec_decode_request_accept_length")))
    table.add_row("micro accept rate", _fmt(summary.micro_accept_rate), "")
    table.add_row("micro accept length", _fmt(summary.micro_accept_length), "")
    table.add_row("requests without drafts", str(summary.num_without_speculation), "")
    console.print(table)


def run_demo(*, num_prompts: int, max_tokens: int, temperature: float, model: str) -> None:
    """Start the service on ``model``, send ``num_prompts`` prompts, print acceptance."""
    console = Console()
    prompts = [prompt for prompt, _ in arithmetic_prompts(num_prompts, seed=0)]
    log_path = Path(tempfile.mkdtemp(prefix="rollout-demo-")) / "service.log"
    with ServiceProcess(log_path, model=model) as service:
        with console.status(f"starting the service on {model} (log: {log_path})"):
            service.wait_healthy(timeout_s=600)
            health = asyncio.run(_health(service.url))
        console.print(f"service up at {service.url}: model {health.model}, "
                      f"engine {health.engine}")
        asyncio.run(_rollout(service.url, prompts, max_tokens, temperature, console))


async def _health(url: str) -> messages.HealthResponse:
    async with RolloutClient(url) as client:
        return await client.health()
