"""The RL frameworks' own rollout clients against the service: does each one work unmodified?

Runs in the caller's terminal process. Against a running service (``--url``) or one it
starts itself (default: ``rollout-service serve`` on the embedded tiny model, MTP with
k = 2, as a child process), it sends each framework's HTTP calls in the exact shapes of
its published source, reads back the response fields that source reads, and prints one
row per client: ``client | dialect | calls | result`` (``ok``, or each failing call with
its status and message). The exit status is 1 when any call failed.

Each client runs in one of two ways (``--mode``):

- ``real``: the framework's own code, imported as published, drives the calls: vLLM's
  benchmark client (``vllm.benchmarks.serve``), SkyRL's ``RemoteInferenceClient``,
  AReaL's ``SGLangBackend`` / ``VLLMBackend`` request builders and parsers with its own
  ``ModelRequest``, slime's ``sglang_rollout.generate`` / ``generate_streaming`` /
  ``server_control`` / ``SGLangEngine`` calls, NeMo-RL's ``SGLangGeneration`` request
  path. None of them is vendored here: install them beside this script to use them.
- ``data``: the same calls as payloads written out below, each citing the upstream
  repository, file and function it mirrors (the frameworks' packages need Python 3.12 and
  heavy dependencies; vLLM's benchmark client imports in the project's environment).

``auto`` (the default) takes ``real`` where the framework imports and ``data`` elsewhere.
Mid-generation steps (pause, abort, partial rollouts) start a ``--long-tokens`` request,
wait until the service runs it (SGLang's ``GET /v1/loads``, which the service serves in
every dialect), then act; a request that ends before the act is reported as a failure
(raise ``--long-tokens``). The frameworks send no API key (``--api-key`` is added to the
``data`` calls only): point them at a service without ``api_key``.

    python -m bench.dialect_clients
    python -m bench.dialect_clients --url http://127.0.0.1:8000 --tokenizer CHECKPOINT_DIR
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
from rich.console import Console
from rich.table import Table

PROMPT_IDS = [17, 294, 258, 270]
"""The prompt every client sends, as token ids below any vocabulary's size."""
SHORT_TOKENS = 16
HTTP_TIMEOUT_S = 300.0
SKYRL = "SkyRL 0.4.0"
AREAL = "AReaL 1.0.4"
SLIME = "slime"
NEMO = "NeMo-RL"
SLIME_AT = "THUDM/slime@624b824"
NEMO_AT = "NVIDIA-NeMo/RL@7ea279a"
"""The commits of the two frameworks read (neither publishes a package)."""
CLIENTS = ("vllm-bench", "skyrl", "areal-sglang", "areal-vllm", "slime", "nemo-rl")

SOURCES: dict[str, list[str]] = {
    "vllm-bench": [
        "vllm-project/vllm 0.32.0 vllm/benchmarks/serve.py (main) and "
        "vllm/benchmarks/lib/endpoint_request_func.py (async_request_openai_completions, "
        "async_request_openai_chat_completions)"],
    "skyrl": [
        "skyrl 0.4.0 skyrl/backends/skyrl_train/inference_servers/remote_inference_client.py "
        "(RemoteGenerateClient.generate, RemoteInferenceClient.generate / sample / tokenize / "
        "detokenize / completion / chat_completion / pause / resume / reset_prefix_cache / "
        "get_world_size)",
        "skyrl 0.4.0 skyrl/backends/skyrl_train/inference_servers/engine_utils.py "
        "(get_vllm_sampling_params) over skyrl/train/config/config.py (SamplingParams)"],
    "areal-sglang": [
        "areal 1.0.4 areal/engine/sglang_remote.py (SGLangBackend.build_generation_request, "
        "parse_generation_response, build_score_request, parse_score_response, "
        "get_pause_request, get_resume_request, get_health_check_request)",
        "areal 1.0.4 areal/infra/remote_inf_engine.py (RemoteInfEngine.agenerate: the "
        "partial-rollout resubmit; pause_generation / continue_generation)",
        "areal 1.0.4 areal/api/cli_args.py (GenerationHyperparameters defaults)"],
    "areal-vllm": [
        "areal 1.0.4 areal/engine/vllm_remote.py (VLLMBackend.build_generation_request, "
        "parse_generation_response, build_score_request, parse_score_response, "
        "get_pause_request, get_resume_request, get_health_check_request)",
        "areal 1.0.4 areal/infra/remote_inf_engine.py (RemoteInfEngine.agenerate)"],
    "slime": [
        f"{SLIME_AT} slime/rollout/sglang_rollout.py (GenerateState.__init__, generate)",
        f"{SLIME_AT} slime/rollout/sglang_streaming_rollout.py (generate_streaming)",
        f"{SLIME_AT} slime/utils/types.py (Sample.append_response_tokens, _apply_meta_info)",
        f"{SLIME_AT} slime/backends/sglang_utils/server_control.py "
        "(abort_servers_until_idle, num_requests_from_load)",
        f"{SLIME_AT} slime/backends/sglang_utils/sglang_engine.py (SGLangEngine."
        "health_generate, pause_generation, continue_generation, flush_cache, "
        "get_weight_version)",
        f"{SLIME_AT} slime/backends/sglang_utils/external.py (get_server_info)"],
    "nemo-rl": [
        f"{NEMO_AT} nemo_rl/models/generation/sglang/sglang_generation.py "
        "(SGLangGeneration._build_sampling_params, generate_one_sample)",
        f"{NEMO_AT} nemo_rl/models/generation/sglang/sglang_worker.py "
        "(SGLangGenerationWorker.health_generate, invalidate_kv_cache)"],
}


# --- results ------------------------------------------------------------------------

class CallFailed(Exception):
    """One call answered what its client cannot use."""

    def __init__(self, call: str, why: str) -> None:
        super().__init__(f"{call}: {why}")
        self.call = call
        self.why = why


def expect(condition: bool, call: str, why: str) -> None:
    if not condition:
        raise CallFailed(call, why)


@dataclasses.dataclass
class Row:
    """One client's calls and what failed."""

    client: str
    dialect: str
    code: str = "data"
    calls: list[str] = dataclasses.field(default_factory=list)
    failures: list[str] = dataclasses.field(default_factory=list)
    skipped: str | None = None

    def call(self, label: str) -> None:
        if label not in self.calls:
            self.calls.append(label)

    async def step(self, name: str, fn: Callable[[], Awaitable[None]]) -> None:
        """Run one step; a failure is recorded and the next steps still run."""
        try:
            await fn()
        except CallFailed as exc:
            self.failures.append(f"{exc.call}: {exc.why}")
        except Exception as exc:  # the real clients raise their own types
            self.failures.append(f"{name}: {type(exc).__name__}: {_short(str(exc))}")

    @property
    def label(self) -> str:
        how = {"real": "its own client code", "data": "payloads from its source"}.get(
            self.code, "skipped")
        return f"{self.client} ({how})"


def _short(text: str, limit: int = 240) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


def error_message(resp: httpx.Response) -> str:
    """The message of an error answer: OpenAI's ``error.message``, FastAPI's ``detail``,
    or the text."""
    try:
        body = resp.json()
    except ValueError:
        return _short(resp.text or resp.reason_phrase)
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return _short(str(error["message"]))
        if isinstance(error, str):
            return _short(error)
        if body.get("detail"):
            return _short(str(body["detail"]))
    return _short(resp.text)


def failed_call(exc: Exception, call: str) -> CallFailed:
    """A real client's HTTP error as the call that failed (aiohttp, requests, httpx)."""
    status = getattr(exc, "status", None) or getattr(exc, "status_code", None)
    response = getattr(exc, "response", None)
    if status is None and response is not None:
        status = getattr(response, "status_code", None)
    message = getattr(exc, "message", None) or str(exc)
    if isinstance(response, httpx.Response):
        message = error_message(response)
    elif response is not None and hasattr(response, "json"):  # requests
        with contextlib.suppress(Exception):
            message = response.json()["error"]["message"]
    return CallFailed(call, _short(f"{status or type(exc).__name__} {message}"))


# --- the service under test -----------------------------------------------------------

@dataclasses.dataclass
class Target:
    url: str
    model: str
    tokenizer: str | None
    api_key: str | None
    long_tokens: int
    http: httpx.AsyncClient

    @property
    def host_port(self) -> str:
        return self.url.split("://", 1)[-1].rstrip("/")

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def send(self, row: Row, method: str, path: str, *, params: dict[str, Any] | None = None,
                   json_body: Any = None, headers: dict[str, str] | None = None,
                   label: str | None = None) -> httpx.Response:
        """One call as its client sends it; a status >= 400 fails it."""
        label = label or f"{method} {path}" + (f"?{urlencode(params)}" if params else "")
        row.call(label)
        resp = await self.http.request(method, self.url + path, params=params, json=json_body,
                                       headers={**self.auth, **(headers or {})})
        if resp.status_code >= 400:
            raise CallFailed(label, f"{resp.status_code} {error_message(resp)}")
        return resp

    async def running(self) -> int | None:
        """Requests the service runs now (SGLang's ``/v1/loads``), None without the route."""
        try:
            resp = await self.http.get(self.url + "/v1/loads", params={"include": "core"},
                                       headers=self.auth)
        except httpx.HTTPError:
            return None
        if resp.status_code != 200:
            return None
        return sum(int(load.get("num_running_reqs", 0)) for load in resp.json().get("loads", []))

    async def in_flight(self, task: asyncio.Future[Any]) -> None:
        """Until ``task``'s request runs and has made some tokens (or 0.5 s without
        ``/v1/loads``)."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not task.done():
            running = await self.running()
            if running is None:
                await asyncio.sleep(0.5)
                return
            if running > 0:
                await asyncio.sleep(0.1)
                return
            await asyncio.sleep(0.05)


def check_partial(call: str, tokens: list[int], logprobs: list[float] | None,
                  finish: str | None, wanted: int) -> None:
    """An aborted sequence: finish reason abort, its tokens so far, one logprob each."""
    expect(not (finish in ("length", "stop") and len(tokens) >= wanted), call,
           f"the request ended ({finish}, {len(tokens)} tokens) before the abort: raise "
           "--long-tokens")
    expect(finish == "abort", call, f"finish reason {finish!r}, wanted 'abort'")
    expect(0 < len(tokens) < wanted, call, f"{len(tokens)} tokens, wanted 1..{wanted - 1}")
    expect(logprobs is None or len(logprobs) == len(tokens), call,
           f"{len(logprobs or [])} logprobs for {len(tokens)} tokens")


# --- vLLM's benchmark client ------------------------------------------------------------

async def vllm_bench(t: Target, mode: str) -> list[Row]:
    """``vllm bench serve`` (run as a module: the console script needs the ``vllm``
    distribution name) with its ``openai`` and ``openai-chat`` backends."""
    rows = [Row("vLLM benchmark client", "vLLM OpenAI", code="real")
            for _ in range(2)]
    try:
        from vllm.benchmarks.serve import add_cli_args, main
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError as exc:
        for row in rows:
            _skip(row, mode, f"vllm does not import: {exc}")
        return rows
    if t.tokenizer is None:
        for row in rows:
            _skip(row, mode, "needs --tokenizer")
        return rows
    if t.api_key:
        os.environ["OPENAI_API_KEY"] = t.api_key
    num_prompts = 32
    for row, (backend, endpoint) in zip(rows, (("openai", "/v1/completions"),
                                               ("openai-chat", "/v1/chat/completions"))):
        row.client = f"vLLM benchmark client, backend {backend}"
        parser = FlexibleArgumentParser()
        add_cli_args(parser)
        args = parser.parse_args([
            "--backend", backend, "--base-url", t.url, "--endpoint", endpoint,
            "--model", t.model, "--tokenizer", t.tokenizer, "--dataset-name", "random",
            "--random-input-len", "32", "--random-output-len", "32",
            "--num-prompts", str(num_prompts), "--max-concurrency", "8", "--disable-tqdm",
            "--save-detailed", "--seed", "0"])
        label = f"POST {endpoint} (stream, x{num_prompts})"
        row.call(label)

        async def run(row: Row = row, args: argparse.Namespace = args, label: str = label
                      ) -> None:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                result = await asyncio.to_thread(main, args)
            errors = [e for e in result.get("errors", []) if e]
            expect(result.get("failed", 1) == 0 and result.get("completed") == num_prompts,
                   label, f"{result.get('failed')} of {num_prompts} failed"
                   + (f": {_short(errors[0])}" if errors else ""))

        await row.step(label, run)
    return rows


def _skip(row: Row, mode: str, why: str) -> None:
    if mode == "real":
        row.failures.append(f"real client unavailable: {why}")
    else:
        row.code, row.skipped = "skipped", why


# --- SkyRL 0.4.0: vLLM's dialect ----------------------------------------------------------

def skyrl_sampling(max_tokens: int, **extra: Any) -> dict[str, Any]:
    """skyrl/backends/skyrl_train/inference_servers/engine_utils.py::get_vllm_sampling_params
    over the defaults of skyrl/train/config/config.py::SamplingParams (extra keys come from
    its ``additional_kwargs``)."""
    return {"min_tokens": 1, "skip_special_tokens": True, "include_stop_str_in_output": True,
            "max_tokens": max_tokens, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
            "min_p": 0.0, "logprobs": 1, "stop": None, **extra}


def skyrl_sample_body(t: Target) -> dict[str, Any]:
    """RemoteInferenceClient.sample: a Tinker request -> ``/inference/v1/generate``."""
    return {"sampling_params": {"n": 2, "logprobs": 0, "output_kind": 2, "prompt_logprobs": 2,
                                "temperature": 1.0, "max_tokens": 8, "seed": 1},
            "model": t.model, "token_ids": PROMPT_IDS}


def check_skyrl_choice(call: str, choice: dict[str, Any], wanted: int | None = None) -> None:
    """What RemoteGenerateClient.generate reads: ``token_ids``, ``logprobs.content[].logprob``,
    ``finish_reason``."""
    tokens = choice["token_ids"]
    logprobs = [c["logprob"] for c in (choice.get("logprobs") or {}).get("content") or []]
    expect(bool(tokens) and len(logprobs) == len(tokens), call,
           f"{len(tokens)} token_ids, {len(logprobs)} logprobs.content")
    expect(choice["finish_reason"] in ("stop", "length"), call,
           f"finish_reason {choice['finish_reason']!r}")
    if wanted is not None:
        expect(len(tokens) == wanted and choice["finish_reason"] == "length", call,
               f"{len(tokens)} tokens ({choice['finish_reason']}), wanted {wanted} (length)")


def check_prompt_logprobs(call: str, prompt_logprobs: Any) -> None:
    """skyrl/backends/utils.py::convert_vllm_prompt_logprobs: per prompt position (None first)
    a map str(token id) -> {logprob}, the prompt's own token among them."""
    expect(isinstance(prompt_logprobs, list) and len(prompt_logprobs) == len(PROMPT_IDS), call,
           f"prompt_logprobs {_short(json.dumps(prompt_logprobs), 80)}")
    own = [(pos or {}).get(str(tid), {}).get("logprob") for tid, pos in
           zip(PROMPT_IDS, prompt_logprobs)]
    expect(own[0] is None and all(isinstance(v, float) for v in own[1:]), call,
           f"the prompt tokens' own logprobs {own}")


async def skyrl(t: Target, mode: str) -> list[Row]:
    main = Row(f"{SKYRL} generate, sample, pause", "vLLM")
    tok = Row(f"{SKYRL} tokenize, detokenize", "vLLM")
    client_mod = None
    if mode != "data":
        try:
            from skyrl.backends.skyrl_train.inference_servers import (
                remote_inference_client as client_mod,
            )
        except ImportError as exc:
            if mode == "real":
                for row in (main, tok):
                    row.failures.append(f"real client unavailable: {exc}")
                return [main, tok]
    if client_mod is not None:
        main.code = tok.code = "real"
        await skyrl_real(t, client_mod, main, tok)
    else:
        await skyrl_data(t, main, tok)
    return [main, tok]


async def skyrl_data(t: Target, main: Row, tok: Row) -> None:
    headers = {"Content-Type": "application/json", "X-Session-ID": "session-0"}
    gen = "POST /inference/v1/generate"

    def body(max_tokens: int, **extra: Any) -> dict[str, Any]:
        # RemoteGenerateClient.generate: sampling_params, model, token_ids (cache_salt and
        # features only when given)
        return {"sampling_params": skyrl_sampling(max_tokens, **extra), "model": t.model,
                "token_ids": PROMPT_IDS}

    async def generate() -> None:
        resp = await t.send(main, "POST", "/inference/v1/generate",
                            json_body=body(SHORT_TOKENS), headers=headers)
        check_skyrl_choice(gen, resp.json()["choices"][0])

    async def sample() -> None:
        resp = await t.send(main, "POST", "/inference/v1/generate", json_body=skyrl_sample_body(t),
                            headers={"Content-Type": "application/json"})
        answer = resp.json()
        expect(len(answer["choices"]) == 2, gen, f"{len(answer['choices'])} choices for n=2")
        for choice in answer["choices"]:
            check_skyrl_choice(gen, choice)
        check_prompt_logprobs(gen, answer.get("prompt_logprobs"))

    async def world_size() -> None:
        # RemoteInferenceClient.get_world_size: GET with a JSON body {}, reads body.world_size
        resp = await t.send(main, "GET", "/get_world_size", json_body={})
        expect(isinstance(resp.json().get("world_size"), int), "GET /get_world_size",
               f"world_size {resp.json().get('world_size')!r}")

    async def pause(mode: str) -> None:
        long = t.long_tokens
        task = asyncio.ensure_future(t.http.post(
            t.url + "/inference/v1/generate", json=body(long, ignore_eos=True),
            headers={**t.auth, **headers}))
        await t.in_flight(task)
        # RemoteInferenceClient.pause: POST, query mode and clear_cache, no body
        label = f"POST /pause?mode={mode}&clear_cache=false"
        try:
            await t.send(main, "POST", "/pause", params={"mode": mode, "clear_cache": "false"},
                         label=label)
            if mode == "keep":
                await asyncio.sleep(0.5)
                expect(not task.done(), label, "the kept request finished while paused")
        finally:
            await t.send(main, "POST", "/resume")
            resp = await task
        expect(resp.status_code == 200, gen, f"{resp.status_code} {error_message(resp)}")
        choice = resp.json()["choices"][0]
        if mode == "abort":
            lps = [c["logprob"] for c in (choice.get("logprobs") or {}).get("content") or []]
            check_partial(f"{gen} under {label}", choice["token_ids"], lps,
                          choice["finish_reason"], long)
        else:
            check_skyrl_choice(f"{gen} under {label}", choice, wanted=long)

    async def reset_prefix_cache() -> None:
        # RemoteInferenceClient.reset_prefix_cache: JSON body {reset_running_requests}
        resp = await t.send(main, "POST", "/reset_prefix_cache",
                            json_body={"reset_running_requests": False})
        expect("success" in resp.json(), "POST /reset_prefix_cache", resp.text)

    async def passthrough() -> None:
        # RemoteInferenceClient.completion / chat_completion: the body as given, model set
        resp = await t.send(main, "POST", "/v1/completions", json_body={
            "prompt": PROMPT_IDS, "max_tokens": 8, "logprobs": 1, "return_token_ids": True,
            "model": t.model}, headers={"Content-Type": "application/json"})
        choice = resp.json()["choices"][0]
        expect(len(choice.get("token_ids") or []) == 8, "POST /v1/completions",
               f"token_ids {choice.get('token_ids')}")
        await t.send(main, "POST", "/v1/chat/completions", json_body={
            "messages": [{"role": "user", "content": "1 + 1 ="}], "max_tokens": 8,
            "model": t.model}, headers={"Content-Type": "application/json"})

    async def tokenize() -> None:
        # RemoteInferenceClient.tokenize without a tokenizer: {model, prompt,
        # add_special_tokens} -> tokens
        resp = await t.send(tok, "POST", "/tokenize", json_body={
            "model": t.model, "prompt": "1 + 1 =", "add_special_tokens": True})
        expect(bool(resp.json().get("tokens")), "POST /tokenize", resp.text)

    async def detokenize() -> None:
        # RemoteInferenceClient.detokenize, and generate() after each generation when
        # built without a tokenizer: {model, tokens} -> prompt
        resp = await t.send(tok, "POST", "/detokenize", json_body={
            "model": t.model, "tokens": PROMPT_IDS})
        expect(isinstance(resp.json().get("prompt"), str), "POST /detokenize", resp.text)

    await main.step("generate", generate)
    await main.step("sample", sample)
    await main.step("get_world_size", world_size)
    for mode in ("keep", "abort", "wait"):
        await main.step(f"pause {mode}", lambda mode=mode: pause(mode))
    await main.step("reset_prefix_cache", reset_prefix_cache)
    await main.step("completion", passthrough)
    await tok.step("tokenize", tokenize)
    await tok.step("detokenize", detokenize)


async def skyrl_real(t: Target, mod: Any, main: Row, tok: Row) -> None:
    try:
        from skyrl.backends.skyrl_train.inference_servers.engine_utils import (
            get_vllm_sampling_params,
        )
        from skyrl.train.config.config import SamplingParams

        def sampling(max_tokens: int, **extra: Any) -> dict[str, Any]:
            return get_vllm_sampling_params(SamplingParams(
                max_generate_length=max_tokens, additional_kwargs=extra or None))
    except ImportError:  # skyrl.train needs skyrl-gym: the same dict, from its source
        sampling = skyrl_sampling
    tokenizer = None
    if t.tokenizer is not None:
        with contextlib.suppress(Exception):
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(t.tokenizer)
    # inference_servers/setup.py::build_new_inference_client with external_proxy_url only:
    # one server is proxy and control plane; the trainer passes its tokenizer (so generate()
    # does not call /detokenize)
    client = mod.RemoteInferenceClient(proxy_url=t.url, server_urls=[t.url],
                                       data_parallel_size=1, model_name=t.model,
                                       tokenizer=tokenizer)
    bare = mod.RemoteInferenceClient(proxy_url=t.url, server_urls=[t.url],
                                     data_parallel_size=1, model_name=t.model)
    gen_client = mod.RemoteGenerateClient(proxy_url=t.url)
    gen = "POST /inference/v1/generate"

    async def call(row: Row, label: str, coro: Awaitable[Any]) -> Any:
        row.call(label)
        try:
            return await coro
        except Exception as exc:
            raise failed_call(exc, label) from exc

    async def generate() -> None:
        result = await call(main, gen, gen_client.generate(
            prompt_token_ids=PROMPT_IDS, sampling_params=sampling(SHORT_TOKENS),
            session_id="session-0", model=t.model))
        check_skyrl_choice(gen, result.raw_response["choices"][0])
        expect(result.response_logprobs is not None
               and len(result.response_logprobs) == len(result.response_ids), gen,
               "response_logprobs do not match response_ids")
        if tokenizer is not None:  # the trainer's path: RemoteInferenceClient.generate
            out = await call(main, gen, client.generate({
                "prompt_token_ids": [PROMPT_IDS], "sampling_params": sampling(SHORT_TOKENS),
                "session_ids": ["session-1"]}))
            expect(out["stop_reasons"][0] in ("stop", "length") and out["responses"][0]
                   is not None, gen, f"stop_reasons {out['stop_reasons']}")

    async def sample() -> None:
        out = await call(main, gen, client.sample({"json": {
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT_IDS}]},
            "num_samples": 2, "sampling_params": {"temperature": 1.0, "max_tokens": 8, "seed": 1},
            "include_prompt_logprobs": True, "topk_prompt_logprobs": 2}}))
        expect(len(out["sequences"]) == 2 and all(
            len(s["tokens"]) == len(s["logprobs"] or []) > 0 for s in out["sequences"]), gen,
            f"sequences {_short(json.dumps(out['sequences']), 120)}")
        expect(out["prompt_logprobs"] is not None and out["prompt_logprobs"][0] is None
               and all(isinstance(v, float) for v in out["prompt_logprobs"][1:]), gen,
               f"prompt_logprobs {out['prompt_logprobs']}")

    async def world_size() -> None:
        total, per_server = await call(main, "GET /get_world_size", client.get_world_size())
        expect(total >= 1 and per_server >= 1, "GET /get_world_size", f"{total}, {per_server}")

    async def pause(mode: str) -> None:
        long = t.long_tokens
        task = asyncio.ensure_future(gen_client.generate(
            prompt_token_ids=PROMPT_IDS, sampling_params=sampling(long, ignore_eos=True),
            session_id=None, model=t.model))
        await t.in_flight(task)
        label = f"POST /pause?mode={mode}&clear_cache=false"
        try:
            await call(main, label, client.pause(mode))
            if mode == "keep":
                await asyncio.sleep(0.5)
                expect(not task.done(), label, "the kept request finished while paused")
        finally:
            await call(main, "POST /resume", client.resume())
            result = await call(main, gen, task)
        if mode == "abort":
            check_partial(f"{gen} under {label}", result.response_ids, result.response_logprobs,
                          result.stop_reason, long)
        else:
            check_skyrl_choice(f"{gen} under {label}", result.raw_response["choices"][0],
                               wanted=long)

    async def reset_prefix_cache() -> None:
        answers = await call(main, "POST /reset_prefix_cache", client.reset_prefix_cache())
        expect(all("success" in (a["body"] or {}) for a in answers.values()),
               "POST /reset_prefix_cache", str(answers))

    async def passthrough() -> None:
        out = await call(main, "POST /v1/completions", client.completion({"json": {
            "prompt": PROMPT_IDS, "max_tokens": 8, "logprobs": 1, "return_token_ids": True}}))
        expect(len(out["choices"][0].get("token_ids") or []) == 8, "POST /v1/completions",
               "no token_ids")
        await call(main, "POST /v1/chat/completions", client.chat_completion({"json": {
            "messages": [{"role": "user", "content": "1 + 1 ="}], "max_tokens": 8}}))

    async def tokenize() -> None:
        ids = await call(tok, "POST /tokenize", bare.tokenize(["1 + 1 ="]))
        expect(bool(ids and ids[0]), "POST /tokenize", str(ids))

    async def detokenize() -> None:
        texts = await call(tok, "POST /detokenize", bare.detokenize([PROMPT_IDS]))
        expect(isinstance(texts[0], str), "POST /detokenize", str(texts))

    try:
        await main.step("generate", generate)
        await main.step("sample", sample)
        await main.step("get_world_size", world_size)
        for mode in ("keep", "abort", "wait"):
            await main.step(f"pause {mode}", lambda mode=mode: pause(mode))
        await main.step("reset_prefix_cache", reset_prefix_cache)
        await main.step("completion", passthrough)
        await tok.step("tokenize", tokenize)
        await tok.step("detokenize", detokenize)
    finally:
        for closing in (client, bare):
            await closing.teardown()
        await gen_client.aclose()


# --- AReaL 1.0.4: both backends ---------------------------------------------------------

TOP_K_ALL = int(1e8)
"""areal/api/cli_args.py::GenerationHyperparameters.top_k's default."""


@dataclasses.dataclass
class HttpCall:
    """AReaL's ``HttpRequest``: endpoint, payload, method."""

    endpoint: str
    payload: dict[str, Any]
    method: str = "POST"


@dataclasses.dataclass
class Generated:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str


class AReaLShapes:
    """One AReaL backend's requests and parsers: its own (``real``) or as data."""

    def __init__(self, backend: str, real: bool) -> None:
        self.backend = backend
        self.real = real
        if real:
            from areal.api import ModelRequest
            from areal.api.cli_args import GenerationHyperparameters
            if backend == "sglang":
                from areal.engine.sglang_remote import SGLangBackend as Backend
            else:
                from areal.engine.vllm_remote import VLLMBackend as Backend
            self._impl = Backend()
            self._request, self._gconfig = ModelRequest, GenerationHyperparameters

    def _as_call(self, http_req: Any) -> HttpCall:
        return HttpCall(http_req.endpoint, http_req.payload, http_req.method)

    def generation(self, input_ids: list[int], max_new_tokens: int, ignore_eos: bool) -> HttpCall:
        if self.real:
            req = self._request(input_ids=list(input_ids), gconfig=self._gconfig(
                max_new_tokens=max_new_tokens, ignore_eos=ignore_eos))
            return self._as_call(self._impl.build_generation_request(req, with_lora=False,
                                                                     version=0))
        if self.backend == "sglang":
            # sglang_remote.py::SGLangBackend.build_generation_request, defaults of
            # GenerationHyperparameters; ModelRequest.image_data defaults to []
            return HttpCall("/generate", {
                "input_ids": list(input_ids), "image_data": [],
                "sampling_params": {
                    "top_p": 1.0, "top_k": TOP_K_ALL, "max_new_tokens": max_new_tokens,
                    "temperature": 1.0, "stop_token_ids": [], "ignore_eos": ignore_eos,
                    "skip_special_tokens": True, "frequency_penalty": 0.0},
                "return_logprob": True, "stream": False})
        # vllm_remote.py::VLLMBackend.build_generation_request: a flat body, no model
        return HttpCall("/v1/completions", {
            "top_p": 1.0, "top_k": TOP_K_ALL, "max_tokens": max_new_tokens, "temperature": 1.0,
            "stop_token_ids": [], "ignore_eos": ignore_eos, "skip_special_tokens": True,
            "return_tokens_as_token_ids": True, "logprobs": 0, "use_beam_search": False,
            "stream": False, "prompt": list(input_ids)})

    def parse(self, answer: dict[str, Any]) -> Generated:
        if self.real:
            result = self._impl.parse_generation_response(answer)
            return Generated(list(result.output_tokens), list(result.output_logprobs),
                             result.stop_reason)
        if self.backend == "sglang":
            # parse_generation_response reads meta_info.finish_reason.type (and .message),
            # meta_info.output_token_logprobs[i] = [logprob, token id, ...]
            meta = answer["meta_info"]
            entries = meta["output_token_logprobs"]
            return Generated([e[1] for e in entries], [e[0] for e in entries],
                             meta["finish_reason"]["type"])
        # parse_generation_response reads choices[0].finish_reason and
        # choices[0].logprobs.tokens ("token_id:N") / token_logprobs
        choice = answer["choices"][0]
        logprobs = choice["logprobs"]
        return Generated([int(tok.split(":")[1]) for tok in logprobs["tokens"]],
                         list(logprobs["token_logprobs"]), choice["finish_reason"])

    def control(self, name: str) -> HttpCall:
        """``pause``, ``resume`` or ``health``."""
        if self.real:
            getter = {"pause": "get_pause_request", "resume": "get_resume_request",
                      "health": "get_health_check_request"}[name]
            return self._as_call(getattr(self._impl, getter)())
        if name == "health":
            return HttpCall("/health", {}, "GET")
        routes = {"sglang": {"pause": "/pause_generation", "resume": "/continue_generation"},
                  "vllm": {"pause": "/areal_pause_generation",
                           "resume": "/areal_continue_generation"}}
        return HttpCall(routes[self.backend][name], {})

    def score(self, input_ids: list[int], target_len: int) -> HttpCall:
        """The teacher's ``compute_logp`` request."""
        if self.real:
            return self._as_call(self._impl.build_score_request(
                input_ids, target_len, with_lora=False, version=0))
        if self.backend == "sglang":
            return HttpCall("/generate", {
                "input_ids": input_ids,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                "return_logprob": True,
                "logprob_start_len": max(0, len(input_ids) - target_len - 1),
                "top_logprobs_num": 0, "stream": False})
        return HttpCall("/v1/completions", {
            "prompt": input_ids, "max_tokens": 1, "temperature": 0.0, "logprobs": 1,
            "prompt_logprobs": 1, "echo": True})

    def parse_score(self, answer: dict[str, Any], target_len: int) -> list[float]:
        if self.real:
            return list(self._impl.parse_score_response(answer, target_len))
        if self.backend == "sglang":  # meta_info.input_token_logprobs[i][0], the last ones
            return [float(e[0]) for e in answer["meta_info"]["input_token_logprobs"]][
                -target_len:]
        # choices[0].prompt_logprobs, the last target_len positions, each map's first value
        positions = answer["choices"][0]["prompt_logprobs"][-target_len:]
        return [float(next(iter(p.values()))["logprob"]) if p else 0.0 for p in positions]


async def areal(t: Target, mode: str, backend: str) -> list[Row]:
    row = Row(f"{AREAL} {'SGLangBackend' if backend == 'sglang' else 'VLLMBackend'}",
              "SGLang" if backend == "sglang" else "vLLM OpenAI")
    real = False
    if mode != "data":
        try:
            import areal.engine.sglang_remote  # noqa: F401
            import areal.engine.vllm_remote  # noqa: F401
            real = True
        except ImportError as exc:
            if mode == "real":
                row.failures.append(f"real client unavailable: {exc}")
                return [row]
    row.code = "real" if real else "data"
    shapes = AReaLShapes(backend, real)

    async def send(call: HttpCall, label: str | None = None) -> httpx.Response:
        # areal/infra/utils/http.py::arequest_with_retry posts the payload as JSON; the one
        # GET, RemoteInfEngine.check_health, sends it too (requests' json={})
        return await t.send(row, call.method, call.endpoint, json_body=call.payload,
                            label=label)

    async def health() -> None:
        await send(shapes.control("health"))

    async def generate() -> None:
        call = shapes.generation(PROMPT_IDS, SHORT_TOKENS, ignore_eos=False)
        out = shapes.parse((await send(call)).json())
        label = f"POST {call.endpoint}"
        expect(out.stop_reason in ("stop", "length") and bool(out.tokens)
               and len(out.tokens) == len(out.logprobs), label,
               f"{len(out.tokens)} tokens, {len(out.logprobs)} logprobs, {out.stop_reason}")

    async def partial_rollout() -> None:
        """RemoteInfEngine.agenerate across pause_generation / continue_generation: an
        aborted answer's tokens are kept and the prompt plus them resubmitted."""
        wanted = t.long_tokens
        call = shapes.generation(PROMPT_IDS, wanted, ignore_eos=True)
        label = f"POST {call.endpoint}"
        task = asyncio.ensure_future(send(call))
        await t.in_flight(task)
        pause, resume = shapes.control("pause"), shapes.control("resume")
        try:
            await send(pause)
        except CallFailed as exc:
            row.failures.append(f"{exc.call}: {exc.why}")
            await task  # nothing was paused: let the request finish
            await send(resume)  # AReaL continues after its weight update either way
            return
        try:
            first = shapes.parse((await task).json())
        finally:
            await send(resume)
        check_partial(f"{label} under POST {pause.endpoint}", first.tokens, first.logprobs,
                      first.stop_reason, wanted)
        again = shapes.generation(PROMPT_IDS + first.tokens, wanted - len(first.tokens),
                                  ignore_eos=True)
        rest = shapes.parse((await send(again)).json())
        total = len(first.tokens) + len(rest.tokens)
        expect(rest.stop_reason == "length" and total == wanted, f"{label} (resubmitted)",
               f"{total} tokens in all ({rest.stop_reason}), wanted {wanted}")

    async def score() -> None:
        ids = PROMPT_IDS + [11, 12, 13]
        call = shapes.score(ids, 3)
        label = f"POST {call.endpoint} (compute_logp)"
        logps = shapes.parse_score((await send(call, label)).json(), 3)
        expect(len(logps) == 3 and all(v < 0 for v in logps), label, f"logprobs {logps}")

    await row.step("health", health)
    await row.step("generate", generate)
    await row.step("partial rollout", partial_rollout)
    await row.step("compute_logp", score)
    return [row]


# --- slime: SGLang's dialect ----------------------------------------------------------------

def slime_sampling(max_new_tokens: int, top_p: float = 1.0) -> dict[str, Any]:
    """slime/rollout/sglang_rollout.py::GenerateState.__init__ with the defaults of
    slime/utils/arguments.py (--rollout-temperature 1, --rollout-top-p 1, --rollout-top-k -1,
    no stop, --rollout-skip-special-tokens off)."""
    params: dict[str, Any] = {
        "temperature": 1.0, "top_p": top_p, "top_k": -1, "max_new_tokens": max_new_tokens,
        "stop": None, "stop_token_ids": None, "skip_special_tokens": False,
        "no_stop_trim": True, "spaces_between_special_tokens": False}
    if top_p != 1.0:
        params["custom_params"] = {"return_top_p_token_ids": True}
    return params


def check_slime_meta(call: str, answer: dict[str, Any], wanted: int | None = None) -> None:
    """What slime reads from one answer: ``text``, ``meta_info.output_token_logprobs`` and,
    on the final one (Sample._apply_meta_info), ``finish_reason.type``, ``weight_version``,
    ``spec_accept_token_num``, ``spec_draft_token_num``, ``spec_verify_ct``,
    ``completion_tokens``, ``cached_tokens``, ``prompt_tokens``."""
    meta = answer["meta_info"]
    entries = meta.get("output_token_logprobs") or []
    expect(isinstance(answer.get("text"), str) and bool(entries), call, "no text or logprobs")
    expect(meta["finish_reason"]["type"] in ("stop", "length"), call,
           f"finish_reason {meta['finish_reason']}")
    expect(meta.get("completion_tokens") == len(entries), call,
           f"completion_tokens {meta.get('completion_tokens')} for {len(entries)} logprobs")
    if wanted is not None:
        expect(len(entries) == wanted, call, f"{len(entries)} tokens, wanted {wanted}")
    missing = [k for k in ("weight_version", "spec_accept_token_num", "spec_draft_token_num",
                           "spec_verify_ct", "cached_tokens", "prompt_tokens")
               if meta.get(k) is None]
    expect(not missing, call, f"meta_info without {missing}")
    expect(0 <= meta["spec_accept_token_num"] <= meta["spec_draft_token_num"], call,
           f"accepted {meta['spec_accept_token_num']} of {meta['spec_draft_token_num']}")


async def slime(t: Target, mode: str) -> list[Row]:
    row = Row(f"{SLIME} rollout, abort, engine control", "SGLang")
    mods = None
    if mode != "data":
        try:
            from slime.backends.sglang_utils import external, server_control
            from slime.backends.sglang_utils.sglang_engine import SGLangEngine
            from slime.rollout import sglang_rollout, sglang_streaming_rollout
            from slime.utils import http_utils
            from slime.utils.types import Sample
            mods = (sglang_rollout, sglang_streaming_rollout, server_control, SGLangEngine,
                    external, http_utils, Sample)
        except ImportError as exc:
            if mode == "real":
                row.failures.append(f"real client unavailable: {exc}")
                return [row]
        if mods is not None and t.tokenizer is None:
            if mode == "real":
                row.failures.append("real client unavailable: GenerateState loads the "
                                    "checkpoint's tokenizer: give --tokenizer")
                return [row]
            mods = None
    if mods is not None:
        row.code = "real"
        await slime_real(t, row, *mods)
    else:
        await slime_data(t, row)
    return [row]


async def slime_data(t: Target, row: Row) -> None:
    gen = "POST /generate"
    weight_version: list[str] = []

    def body(max_new_tokens: int, **extra: Any) -> dict[str, Any]:
        # sglang_rollout.py::generate: sampling_params, return_logprob, input_ids
        return {"sampling_params": {**slime_sampling(max_new_tokens), **extra},
                "return_logprob": True, "input_ids": PROMPT_IDS}

    async def health() -> None:
        # SGLangEngine.health_generate; _wait_server_healthy adds the server's api_key
        await t.send(row, "GET", "/health_generate",
                     headers={"Content-Type": "application/json; charset=utf-8"})

    async def generate() -> None:
        answer = (await t.send(row, "POST", "/generate", json_body=body(SHORT_TOKENS))).json()
        check_slime_meta(gen, answer, SHORT_TOKENS)
        weight_version.append(answer["meta_info"]["weight_version"])

    async def generate_top_p() -> None:
        label = "POST /generate (--rollout-top-p 0.9)"
        resp = await t.send(row, "POST", "/generate", label=label, json_body={
            "sampling_params": slime_sampling(SHORT_TOKENS, top_p=0.9), "return_logprob": True,
            "input_ids": PROMPT_IDS})
        check_slime_meta(label, resp.json(), SHORT_TOKENS)

    async def stream() -> None:
        # sglang_streaming_rollout.py::generate_streaming: "data:" lines, cumulative
        label = "POST /generate (stream)"
        row.call(label)
        last: dict[str, Any] = {}
        async with t.http.stream("POST", t.url + "/generate", headers=t.auth, json={
                **body(SHORT_TOKENS), "stream": True}) as resp:
            expect(resp.status_code == 200, label, f"{resp.status_code}")
            async for line in resp.aiter_lines():
                if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                    last = json.loads(line[5:])
        check_slime_meta(label, last, SHORT_TOKENS)

    async def abort() -> None:
        long = t.long_tokens
        task = asyncio.ensure_future(t.http.post(t.url + "/generate", headers=t.auth,
                                                 json=body(long, ignore_eos=True)))
        await t.in_flight(task)
        # server_control.py::abort_server_until_idle: abort all, then poll the loads
        await t.send(row, "POST", "/abort_request", json_body={"abort_all": True})
        resp = await task
        expect(resp.status_code == 200, gen, f"{resp.status_code} {error_message(resp)}")
        loads = (await t.send(row, "GET", "/v1/loads", params={"include": "core"})).json()
        running = sum(int(x.get("num_running_reqs", 0)) + int(x.get("num_waiting_reqs", 0))
                      for x in loads.get("loads", []))
        expect(running == 0, "GET /v1/loads?include=core", f"{running} requests after abort")
        meta = resp.json()["meta_info"]
        entries = meta.get("output_token_logprobs") or []
        check_partial(f"{gen} under POST /abort_request", [e[1] for e in entries],
                      [e[0] for e in entries], meta["finish_reason"]["type"], long)

    async def engine_control() -> None:
        # SGLangEngine.pause_generation / continue_generation (json {}), flush_cache (GET)
        await t.send(row, "POST", "/pause_generation", json_body={})
        await t.send(row, "POST", "/continue_generation", json_body={})
        await t.send(row, "GET", "/flush_cache")

    async def get_weight_version() -> None:
        # SGLangEngine.get_weight_version reads weight_version (RolloutManager compares it
        # with the version it pushed)
        version = (await t.send(row, "GET", "/get_weight_version")).json()["weight_version"]
        expect(not weight_version or str(version) == str(weight_version[0]),
               "GET /get_weight_version", f"{version!r}, while /generate's meta_info."
               f"weight_version is {weight_version[0]!r}")

    async def server_info() -> None:
        # external.py::get_server_info for --rollout-external-engine-addrs
        try:
            info = (await t.send(row, "GET", "/server_info")).json()
        except CallFailed as first:
            try:
                info = (await t.send(row, "GET", "/get_server_info")).json()
            except CallFailed as second:
                raise CallFailed(f"{first.call}, {second.call}",
                                 f"{first.why}; {second.why}") from second
        expect("tp_size" in info or "tensor_parallel_size" in info, "GET /server_info",
               "no tp_size")

    await row.step("health_generate", health)
    await row.step("generate", generate)
    await row.step("generate top-p", generate_top_p)
    await row.step("stream", stream)
    await row.step("abort", abort)
    await row.step("engine control", engine_control)
    await row.step("get_weight_version", get_weight_version)
    await row.step("server_info", server_info)


async def slime_real(t: Target, row: Row, sglang_rollout: Any, streaming: Any,
                     server_control: Any, engine_cls: Any, external: Any, http_utils: Any,
                     sample_cls: Any) -> None:
    host, _, port = t.host_port.rpartition(":")
    gen = "POST /generate"

    def make_args(top_p: float = 1.0) -> argparse.Namespace:
        # the fields of slime's arguments that generate(), GenerateState and
        # init_http_client read; the service plays the router (--sglang-router-ip/port)
        return argparse.Namespace(
            hf_checkpoint=t.tokenizer, rollout_temperature=1.0, rollout_top_p=top_p,
            rollout_top_k=-1, rollout_max_response_len=SHORT_TOKENS, rollout_stop=None,
            rollout_stop_token_ids=None, rollout_skip_special_tokens=False,
            sglang_server_concurrency=8, rollout_num_engines=1, sglang_dp_size=1,
            sglang_router_ip=host, sglang_router_port=int(port), ci_test=False,
            use_rollout_routing_replay=False, use_distributed_post=False,
            n_samples_per_prompt=1, sglang_speculative_algorithm="EAGLE",
            partial_rollout=False, router_policy=None)

    args = make_args()
    http_utils.init_http_client(args)
    sglang_rollout.GenerateState.clear_instances()
    state = sglang_rollout.GenerateState(args)
    weight_versions: list[str] = []

    def check_sample(call: str, sample: Any, wanted: int | None) -> None:
        expect(sample.status.name in ("TRUNCATED", "COMPLETED"), call, f"status {sample.status}")
        expect(sample.response_length > 0 and len(sample.rollout_log_probs or [])
               == sample.response_length, call,
               f"{sample.response_length} tokens, {len(sample.rollout_log_probs or [])} logprobs")
        if wanted is not None:
            expect(sample.response_length == wanted, call,
                   f"{sample.response_length} tokens, wanted {wanted}")
        expect(bool(sample.weight_versions), call, "no meta_info.weight_version")
        spec = sample.spec_info
        expect(spec.spec_verify_ct > 0 and 0 <= spec.spec_accept_token_num
               <= spec.spec_draft_token_num, call, f"spec counts {vars(spec)}")

    async def health() -> None:
        engine = engine_cls(args, rank=0)
        engine.server_host, engine.server_port, engine.node_rank = host, int(port), 0
        row.call("GET /health_generate")
        try:
            await asyncio.to_thread(engine.health_generate, 30.0)
        except Exception as exc:
            raise failed_call(exc, "GET /health_generate") from exc

    async def generate() -> None:
        row.call(gen)
        sample = sample_cls(prompt="", tokens=list(PROMPT_IDS), index=0)
        try:
            sample = await sglang_rollout.generate(args, sample, state.sampling_params.copy())
        except Exception as exc:
            raise failed_call(exc, gen) from exc
        check_sample(gen, sample, SHORT_TOKENS)
        weight_versions.extend(sample.weight_versions)

    async def generate_top_p() -> None:
        # generate() posts with 60 retries, one second apart; one try tells the same
        label = "POST /generate (--rollout-top-p 0.9)"
        row.call(label)
        sglang_rollout.GenerateState.clear_instances()
        params = sglang_rollout.GenerateState(make_args(top_p=0.9)).sampling_params
        sglang_rollout.GenerateState.clear_instances()
        sglang_rollout.GenerateState(args)
        try:
            answer = await http_utils.post(f"{t.url}/generate", {
                "sampling_params": params, "return_logprob": True, "input_ids": PROMPT_IDS},
                max_retries=1)
        except Exception as exc:
            raise failed_call(exc, label) from exc
        check_slime_meta(label, answer, SHORT_TOKENS)

    async def stream() -> None:
        label = "POST /generate (stream)"
        row.call(label)
        sample = sample_cls(prompt="", tokens=list(PROMPT_IDS), index=1)
        try:
            sample = await streaming.generate_streaming(args, sample,
                                                        state.sampling_params.copy())
        except Exception as exc:
            raise failed_call(exc, label) from exc
        check_sample(label, sample, SHORT_TOKENS)

    async def abort() -> None:
        long = t.long_tokens
        sample = sample_cls(prompt="", tokens=list(PROMPT_IDS), index=2)
        params = dict(state.sampling_params, max_new_tokens=long, ignore_eos=True)
        task = asyncio.ensure_future(sglang_rollout.generate(args, sample, params))
        await t.in_flight(task)
        # sglang_rollout.py::abort lists the router's workers; here the service is the one
        row.call("POST /abort_request")
        row.call("GET /v1/loads?include=core")
        await server_control.abort_servers_until_idle([t.url])
        sample = await task
        label = f"{gen} under POST /abort_request"
        expect(sample.status.name == "ABORTED", label, f"status {sample.status}")
        check_partial(label, sample.tokens[len(PROMPT_IDS):], sample.rollout_log_probs,
                      "abort", long)
        running = server_control.num_requests_from_load(
            await http_utils.get(f"{t.url}/v1/loads?include=core"))
        expect(running == 0, "GET /v1/loads?include=core", f"{running} requests after abort")

    engine = engine_cls(args, rank=0)
    engine.server_host, engine.server_port, engine.node_rank = host, int(port), 0

    async def engine_call(label: str, fn: Callable[[], Any]) -> Any:
        row.call(label)
        try:
            return await asyncio.to_thread(fn)
        except Exception as exc:
            raise failed_call(exc, label) from exc

    async def engine_control() -> None:
        await engine_call("POST /pause_generation", engine.pause_generation)
        await engine_call("POST /continue_generation", engine.continue_generation)
        await engine_call("GET /flush_cache", engine.flush_cache)

    async def get_weight_version() -> None:
        version = await engine_call("GET /get_weight_version", engine.get_weight_version)
        expect(not weight_versions or str(version) == str(weight_versions[0]),
               "GET /get_weight_version", f"{version!r}, while /generate's meta_info."
               f"weight_version is {weight_versions[0]!r}")

    async def server_info() -> None:
        info = await engine_call("GET /server_info, /get_server_info",
                                 lambda: external.get_server_info(t.url, timeout=30))
        expect("tp_size" in info, "GET /server_info", "no tp_size")

    await row.step("health_generate", health)
    await row.step("generate", generate)
    await row.step("generate top-p", generate_top_p)
    await row.step("stream", stream)
    await row.step("abort", abort)
    await row.step("engine control", engine_control)
    await row.step("get_weight_version", get_weight_version)
    await row.step("server_info", server_info)


# --- NeMo-RL: SGLang's dialect ---------------------------------------------------------------

def nemo_sampling(max_new_tokens: int, greedy: bool) -> dict[str, Any]:
    """nemo_rl/models/generation/sglang/sglang_generation.py::_build_sampling_params, config
    temperature 1, top_p 1, no top_k, no stop token ids, one stop string."""
    params: dict[str, Any] = {"temperature": 0.0 if greedy else 1.0, "top_p": 1.0,
                              "max_new_tokens": max_new_tokens, "no_stop_trim": True,
                              "spaces_between_special_tokens": False}
    if greedy:
        params["top_k"] = 1
    params["stop"] = ["\n\n"]
    return params


async def nemo(t: Target, mode: str) -> list[Row]:
    row = Row(f"{NEMO} SGLang generation", "SGLang")
    mods = None
    if mode != "data":
        try:
            from nemo_rl.models.generation.sglang import sglang_generation, sglang_worker
            from nemo_rl.models.generation.sglang.utils.http_utils import HttpClient
            mods = (sglang_generation, sglang_worker, HttpClient)
        except ImportError as exc:
            if mode == "real":
                row.failures.append(f"real client unavailable: {exc}")
                return [row]
    host, _, port = t.host_port.rpartition(":")
    gen = "POST /generate"

    def check(call: str, tokens: list[int], logprobs: list[float], truncated: bool) -> None:
        # generate_one_sample reads meta_info.output_token_logprobs and
        # meta_info.finish_reason.type == "length"
        expect(bool(tokens) and len(tokens) == len(logprobs), call,
               f"{len(tokens)} tokens, {len(logprobs)} logprobs")
        expect(truncated == (len(tokens) == SHORT_TOKENS), call,
               f"truncated {truncated} with {len(tokens)} of {SHORT_TOKENS} tokens")

    if mods is not None:
        row.code = "real"
        sglang_generation, sglang_worker, http_client = mods
        # SGLangGeneration's request path without its Ray servers and router: the
        # service plays the router (router_ip/router_port)
        generation = object.__new__(sglang_generation.SGLangGeneration)
        generation.sglang_cfg = {"temperature": 1.0, "top_p": 1.0, "top_k": None,
                                 "max_new_tokens": SHORT_TOKENS, "stop_token_ids": None,
                                 "stop_strings": None, "sglang_cfg": {}}
        generation.router_ip, generation.router_port = host, int(port)
        generation._http_client = http_client()
        generation.all_engines, generation._router_actor, generation._async_loop = [], None, None
        worker = object.__new__(sglang_worker.SGLangGenerationWorker.__ray_actor_class__)
        worker.node_rank, worker.server_base_url = 0, t.url

        async def generate(greedy: bool) -> None:
            row.call(gen)
            params = generation._build_sampling_params(greedy=greedy,
                                                       max_new_tokens=SHORT_TOKENS,
                                                       stop_strings=["\n\n"])
            try:
                _, tokens, logprobs, truncated = await generation.generate_one_sample(
                    params, PROMPT_IDS, 0)
            except Exception as exc:
                raise failed_call(exc, gen) from exc
            check(gen + (" (greedy)" if greedy else ""), tokens, logprobs, truncated)

        async def worker_call(label: str, fn: Callable[[], Any]) -> None:
            row.call(label)
            try:
                await asyncio.to_thread(fn)
            except Exception as exc:
                raise failed_call(exc, label) from exc

        await row.step("health_generate", lambda: worker_call("GET /health_generate",
                                                              worker.health_generate))
        await row.step("generate", lambda: generate(False))
        await row.step("generate greedy", lambda: generate(True))
        await row.step("flush_cache", lambda: worker_call("GET /flush_cache",
                                                          worker.invalidate_kv_cache))
        with contextlib.suppress(Exception):
            await generation._http_client.aclose()
        return [row]

    async def generate_data(greedy: bool) -> None:
        # generate_one_sample: sampling_params, return_logprob, input_ids
        answer = (await t.send(row, "POST", "/generate", json_body={
            "sampling_params": nemo_sampling(SHORT_TOKENS, greedy), "return_logprob": True,
            "input_ids": PROMPT_IDS})).json()
        entries = answer["meta_info"].get("output_token_logprobs") or []
        check(gen + (" (greedy)" if greedy else ""), [e[1] for e in entries],
              [e[0] for e in entries], (answer["meta_info"].get("finish_reason") or {}).get(
                  "type") == "length")

    async def health() -> None:
        # SGLangGenerationWorker.health_generate; the start-up wait adds
        # "Authorization: Bearer <api_key>" (None without one)
        await t.send(row, "GET", "/health_generate")

    async def flush() -> None:
        await t.send(row, "GET", "/flush_cache")

    await row.step("health_generate", health)
    await row.step("generate", lambda: generate_data(False))
    await row.step("generate greedy", lambda: generate_data(True))
    await row.step("flush_cache", flush)
    return [row]


# --- running ------------------------------------------------------------------------------

async def run_clients(t: Target, mode: str, clients: list[str]) -> list[Row]:
    runners: dict[str, Callable[[], Awaitable[list[Row]]]] = {
        "vllm-bench": lambda: vllm_bench(t, mode),
        "skyrl": lambda: skyrl(t, mode),
        "areal-sglang": lambda: areal(t, mode, "sglang"),
        "areal-vllm": lambda: areal(t, mode, "vllm"),
        "slime": lambda: slime(t, mode),
        "nemo-rl": lambda: nemo(t, mode),
    }
    rows: list[Row] = []
    for name in clients:
        rows += await runners[name]()
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
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
    parser.add_argument("--clients", default=",".join(CLIENTS),
                        help=f"comma-separated subset of {','.join(CLIENTS)}")
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
        for source in SOURCES[name]:
            console.print(f"  {name}: {source}", soft_wrap=True)
    if args.markdown:
        Path(args.markdown).write_text(markdown(rows))
    return 1 if any(r.failures for r in rows) else 0


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
