"""NeMo-RL's SGLang generation against the service's SGLang dialect.

One row: ``GET /health_generate``; ``POST /generate`` sampled and greedy, read as
``generate_one_sample`` reads them (``meta_info.output_token_logprobs``: a token and a
logprob each; ``meta_info.finish_reason.type == "length"`` exactly when the answer is
truncated at ``max_new_tokens``); ``GET /flush_cache`` (``invalidate_kv_cache``).

``real`` runs ``SGLangGeneration``'s request path without its Ray servers and router (the
service plays the router: ``router_ip`` / ``router_port``) and ``SGLangGenerationWorker``'s
health and cache calls pointed at the service; ``data`` sends the same payloads.

Upstream (NVIDIA-NeMo/RL at 7ea279a): ``nemo_rl/models/generation/sglang/
sglang_generation.py`` (``SGLangGeneration._build_sampling_params``,
``generate_one_sample``), ``nemo_rl/models/generation/sglang/sglang_worker.py``
(``SGLangGenerationWorker.health_generate``, ``invalidate_kv_cache``),
``nemo_rl/models/generation/sglang/utils/http_utils.py`` (``HttpClient``).
"""

from __future__ import annotations

import contextlib
from typing import Any

from .common import (
    PROMPT_IDS,
    SHORT_TOKENS,
    Row,
    Target,
    expect,
    load_real,
    traced,
    traced_thread,
)

NEMO = "NeMo-RL"
NEMO_AT = "NVIDIA-NeMo/RL@7ea279a"
"""The commit read (NeMo-RL publishes no package)."""
SOURCES = [
    f"{NEMO_AT} nemo_rl/models/generation/sglang/sglang_generation.py "
    "(SGLangGeneration._build_sampling_params, generate_one_sample)",
    f"{NEMO_AT} nemo_rl/models/generation/sglang/sglang_worker.py "
    "(SGLangGenerationWorker.health_generate, invalidate_kv_cache)"]
GEN = "POST /generate"
STOP = ["\n\n"]


def nemo_sampling(max_new_tokens: int, greedy: bool) -> dict[str, Any]:
    """_build_sampling_params with config temperature 1, top_p 1, no top_k, no stop token
    ids, one stop string."""
    params: dict[str, Any] = {"temperature": 0.0 if greedy else 1.0, "top_p": 1.0,
                              "max_new_tokens": max_new_tokens, "no_stop_trim": True,
                              "spaces_between_special_tokens": False}
    if greedy:
        params["top_k"] = 1
    params["stop"] = STOP
    return params


def check(call: str, tokens: list[int], logprobs: list[float], truncated: bool) -> None:
    """What generate_one_sample reads: the tokens and their logprobs, and whether the
    answer is truncated."""
    expect(bool(tokens) and len(tokens) == len(logprobs), call,
           f"{len(tokens)} tokens, {len(logprobs)} logprobs")
    expect(truncated == (len(tokens) == SHORT_TOKENS), call,
           f"truncated {truncated} with {len(tokens)} of {SHORT_TOKENS} tokens")


async def run(t: Target, mode: str) -> list[Row]:
    row = Row(f"{NEMO} SGLang generation", "SGLang")

    def load() -> Any:
        from nemo_rl.models.generation.sglang import sglang_generation, sglang_worker
        from nemo_rl.models.generation.sglang.utils.http_utils import HttpClient
        return sglang_generation, sglang_worker, HttpClient

    mods = load_real(mode, [row], load)
    if mods is None and mode == "real":
        return [row]
    if mods is not None:
        row.code = "real"
        await run_real(t, row, *mods)
    else:
        await run_data(t, row)
    return [row]


async def run_real(t: Target, row: Row, sglang_generation: Any, sglang_worker: Any,
                   http_client: Any) -> None:
    generation = object.__new__(sglang_generation.SGLangGeneration)
    generation.sglang_cfg = {"temperature": 1.0, "top_p": 1.0, "top_k": None,
                             "max_new_tokens": SHORT_TOKENS, "stop_token_ids": None,
                             "stop_strings": None, "sglang_cfg": {}}
    generation.router_ip, generation.router_port = t.host_port
    generation._http_client = http_client()
    generation.all_engines, generation._router_actor, generation._async_loop = [], None, None
    worker = object.__new__(sglang_worker.SGLangGenerationWorker.__ray_actor_class__)
    worker.node_rank, worker.server_base_url = 0, t.url

    async def generate(greedy: bool) -> None:
        params = generation._build_sampling_params(greedy=greedy, max_new_tokens=SHORT_TOKENS,
                                                   stop_strings=STOP)
        _, tokens, logprobs, truncated = await traced(
            row, GEN, generation.generate_one_sample(params, PROMPT_IDS, 0))
        check(GEN + (" (greedy)" if greedy else ""), tokens, logprobs, truncated)

    try:
        await row.step("health_generate", lambda: traced_thread(
            row, "GET /health_generate", worker.health_generate))
        await row.step("generate", lambda: generate(False))
        await row.step("generate greedy", lambda: generate(True))
        await row.step("flush_cache", lambda: traced_thread(
            row, "GET /flush_cache", worker.invalidate_kv_cache))
    finally:
        with contextlib.suppress(Exception):
            await generation._http_client.aclose()


async def run_data(t: Target, row: Row) -> None:
    async def generate(greedy: bool) -> None:
        # generate_one_sample: sampling_params, return_logprob, input_ids
        answer = (await t.send(row, "POST", "/generate", json_body={
            "sampling_params": nemo_sampling(SHORT_TOKENS, greedy), "return_logprob": True,
            "input_ids": PROMPT_IDS})).json()
        meta = answer["meta_info"]
        entries = meta.get("output_token_logprobs") or []
        check(GEN + (" (greedy)" if greedy else ""), [e[1] for e in entries],
              [e[0] for e in entries], (meta.get("finish_reason") or {}).get("type") == "length")

    async def health() -> None:
        # SGLangGenerationWorker.health_generate; the start-up wait adds
        # "Authorization: Bearer <api_key>" (None without one)
        await t.send(row, "GET", "/health_generate")

    async def flush() -> None:
        await t.send(row, "GET", "/flush_cache")

    await row.step("health_generate", health)
    await row.step("generate", lambda: generate(False))
    await row.step("generate greedy", lambda: generate(True))
    await row.step("flush_cache", flush)
