"""vLLM's benchmark client against the service's vLLM OpenAI dialect.

Runs ``vllm bench serve`` in the caller's process (as a module: the console script needs
the ``vllm`` distribution name), once with its ``openai`` backend on ``/v1/completions``
and once with ``openai-chat`` on ``/v1/chat/completions``: 32 random prompts of 32 tokens,
32 tokens out, 8 at a time, streamed. A row passes when every request completed. Always
its own code (vLLM imports in the project's environment); without it, or without
``--tokenizer``, the rows are skipped (a failure under ``--mode real``).

Upstream: vllm-project/vllm 0.32.0 ``vllm/benchmarks/serve.py`` (``main``) and
``vllm/benchmarks/lib/endpoint_request_func.py`` (``async_request_openai_completions``,
``async_request_openai_chat_completions``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import os

from .common import Row, Target, expect, short, unavailable

SOURCES = [
    "vllm-project/vllm 0.32.0 vllm/benchmarks/serve.py (main) and "
    "vllm/benchmarks/lib/endpoint_request_func.py (async_request_openai_completions, "
    "async_request_openai_chat_completions)"]
NUM_PROMPTS = 32


async def run(t: Target, mode: str) -> list[Row]:
    backends = (("openai", "/v1/completions"), ("openai-chat", "/v1/chat/completions"))
    rows = [Row(f"vLLM benchmark client, backend {backend}", "vLLM OpenAI", code="real")
            for backend, _ in backends]
    try:
        from vllm.benchmarks.serve import add_cli_args, main
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError as exc:
        for row in rows:
            unavailable(row, mode, f"vllm does not import: {exc}")
        return rows
    if t.tokenizer is None:
        for row in rows:
            unavailable(row, mode, "needs --tokenizer")
        return rows
    if t.api_key:
        os.environ["OPENAI_API_KEY"] = t.api_key
    for row, (backend, endpoint) in zip(rows, backends):
        parser = FlexibleArgumentParser()
        add_cli_args(parser)
        args = parser.parse_args([
            "--backend", backend, "--base-url", t.url, "--endpoint", endpoint,
            "--model", t.model, "--tokenizer", t.tokenizer, "--dataset-name", "random",
            "--random-input-len", "32", "--random-output-len", "32",
            "--num-prompts", str(NUM_PROMPTS), "--max-concurrency", "8", "--disable-tqdm",
            "--save-detailed", "--seed", "0"])
        label = f"POST {endpoint} (stream, x{NUM_PROMPTS})"
        row.call(label)

        async def bench(args: argparse.Namespace = args, label: str = label) -> None:
            with contextlib.redirect_stdout(io.StringIO()):
                result = await asyncio.to_thread(main, args)
            errors = [e for e in result.get("errors", []) if e]
            expect(result.get("failed", 1) == 0 and result.get("completed") == NUM_PROMPTS,
                   label, f"{result.get('failed')} of {NUM_PROMPTS} failed"
                   + (f": {short(errors[0])}" if errors else ""))

        await row.step(label, bench)
    return rows
