"""SkyRL 0.4.0's remote inference client against the service's vLLM dialect.

Two rows. The trainer's path: ``POST /inference/v1/generate`` (token ids in, token ids and
``logprobs.content`` out, the Tinker ``sample`` with ``n = 2`` and prompt logprobs),
``GET /get_world_size``, ``POST /pause`` in each of vLLM's modes during a
``--long-tokens`` request (``keep``: the request survives the pause and finishes; ``abort``:
its tokens so far with finish reason ``abort``; ``wait``), ``/resume``,
``/reset_prefix_cache`` and the ``/v1/completions`` / ``/v1/chat/completions`` pass-through.
Without a local tokenizer (``skyrl serve``, Tinker-style callers): ``POST /tokenize`` and
``/detokenize``, which must agree with the checkpoint's tokenizer as this process's
``transformers`` loads it (the trainer's), and ``generate()``, which detokenizes every
result through ``/detokenize``.

``real`` drives ``RemoteInferenceClient`` / ``RemoteGenerateClient`` with the sampling
parameters of SkyRL's own ``get_vllm_sampling_params``; ``data`` sends the same payloads.

Upstream (skyrl 0.4.0): ``skyrl/backends/skyrl_train/inference_servers/
remote_inference_client.py`` (``RemoteGenerateClient.generate``,
``RemoteInferenceClient.generate`` / ``sample`` / ``tokenize`` / ``detokenize`` /
``completion`` / ``chat_completion`` / ``pause`` / ``resume`` / ``reset_prefix_cache`` /
``get_world_size``), ``inference_servers/engine_utils.py`` (``get_vllm_sampling_params``)
over ``skyrl/train/config/config.py`` (``SamplingParams``), ``inference_servers/setup.py``
(``build_new_inference_client``) and ``skyrl/backends/utils.py``
(``convert_vllm_prompt_logprobs``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from .common import (
    PROMPT_IDS,
    SHORT_TOKENS,
    CallFailed,
    Row,
    Target,
    check_partial,
    error_message,
    expect,
    failed_call,
    load_real,
    local_tokenizer,
    short,
    traced,
)

SKYRL = "SkyRL 0.4.0"
SOURCES = [
    "skyrl 0.4.0 skyrl/backends/skyrl_train/inference_servers/remote_inference_client.py "
    "(RemoteGenerateClient.generate, RemoteInferenceClient.generate / sample / tokenize / "
    "detokenize / completion / chat_completion / pause / resume / reset_prefix_cache / "
    "get_world_size)",
    "skyrl 0.4.0 skyrl/backends/skyrl_train/inference_servers/engine_utils.py "
    "(get_vllm_sampling_params) over skyrl/train/config/config.py (SamplingParams)"]
GEN = "POST /inference/v1/generate"
TEXT = "1 + 1 ="
Steps = list[tuple[Row, str, Callable[[], Awaitable[None]]]]


def skyrl_sampling(max_tokens: int, **extra: Any) -> dict[str, Any]:
    """engine_utils.py::get_vllm_sampling_params over the defaults of config.py's
    SamplingParams (extra keys come from its ``additional_kwargs``)."""
    return {"min_tokens": 1, "skip_special_tokens": True, "include_stop_str_in_output": True,
            "max_tokens": max_tokens, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
            "min_p": 0.0, "logprobs": 1, "stop": None, **extra}


def check_choice(call: str, choice: dict[str, Any], wanted: int | None = None) -> None:
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
    """convert_vllm_prompt_logprobs: per prompt position (None first) a map str(token id) ->
    {logprob}, the prompt's own token among them."""
    expect(isinstance(prompt_logprobs, list) and len(prompt_logprobs) == len(PROMPT_IDS), call,
           f"prompt_logprobs {short(json.dumps(prompt_logprobs), 80)}")
    own = [(pos or {}).get(str(tid), {}).get("logprob") for tid, pos in
           zip(PROMPT_IDS, prompt_logprobs)]
    expect(own[0] is None and all(isinstance(v, float) for v in own[1:]), call,
           f"the prompt tokens' own logprobs {own}")


def check_same(call: str, got: Any, local: Any, what: str, tokenizer: Any) -> None:
    """The service's answer against the checkpoint's tokenizer loaded here (if it loads)."""
    if local is None or got == local:
        return
    import transformers
    raise CallFailed(call, f"{what} {got!r}, the local tokenizer's {local!r} "
                     f"({type(tokenizer).__name__}, transformers {transformers.__version__})")


async def run(t: Target, mode: str) -> list[Row]:
    main = Row(f"{SKYRL} generate, sample, pause", "vLLM")
    tok = Row(f"{SKYRL} without a tokenizer: tokenize, detokenize, generate", "vLLM")

    def load() -> Any:
        from skyrl.backends.skyrl_train.inference_servers import remote_inference_client
        return remote_inference_client

    client_mod = load_real(mode, [main, tok], load)
    if client_mod is None and mode == "real":
        return [main, tok]
    tokenizer = local_tokenizer(t.tokenizer)
    if client_mod is not None:
        main.code = tok.code = "real"
        steps, close = real_steps(t, client_mod, main, tok, tokenizer)
    else:
        steps, close = data_steps(t, main, tok, tokenizer), None
    try:
        for row, name, fn in steps:
            await row.step(name, fn)
    finally:
        if close is not None:
            await close()
    return [main, tok]


def data_steps(t: Target, main: Row, tok: Row, tokenizer: Any) -> Steps:
    headers = {"Content-Type": "application/json", "X-Session-ID": "session-0"}

    def body(max_tokens: int, **extra: Any) -> dict[str, Any]:
        # RemoteGenerateClient.generate: sampling_params, model, token_ids (cache_salt and
        # features only when given)
        return {"sampling_params": skyrl_sampling(max_tokens, **extra), "model": t.model,
                "token_ids": PROMPT_IDS}

    async def generate() -> None:
        resp = await t.send(main, "POST", "/inference/v1/generate",
                            json_body=body(SHORT_TOKENS), headers=headers)
        check_choice(GEN, resp.json()["choices"][0])

    async def sample() -> None:
        # RemoteInferenceClient.sample: a Tinker request -> /inference/v1/generate
        resp = await t.send(main, "POST", "/inference/v1/generate", json_body={
            "sampling_params": {"n": 2, "logprobs": 0, "output_kind": 2, "prompt_logprobs": 2,
                                "temperature": 1.0, "max_tokens": 8, "seed": 1},
            "model": t.model, "token_ids": PROMPT_IDS},
            headers={"Content-Type": "application/json"})
        answer = resp.json()
        expect(len(answer["choices"]) == 2, GEN, f"{len(answer['choices'])} choices for n=2")
        for choice in answer["choices"]:
            check_choice(GEN, choice)
        check_prompt_logprobs(GEN, answer.get("prompt_logprobs"))

    async def world_size() -> None:
        # RemoteInferenceClient.get_world_size: GET with a JSON body {}, reads world_size
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
        expect(resp.status_code == 200, GEN, f"{resp.status_code} {error_message(resp)}")
        choice = resp.json()["choices"][0]
        if mode == "abort":
            lps = [c["logprob"] for c in (choice.get("logprobs") or {}).get("content") or []]
            check_partial(f"{GEN} under {label}", choice["token_ids"], lps,
                          choice["finish_reason"], long)
        else:
            check_choice(f"{GEN} under {label}", choice, wanted=long)

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
            "messages": [{"role": "user", "content": TEXT}], "max_tokens": 8,
            "model": t.model}, headers={"Content-Type": "application/json"})

    async def detokenize(ids: list[int]) -> str:
        # RemoteInferenceClient.detokenize without a tokenizer: {model, tokens} -> prompt
        resp = await t.send(tok, "POST", "/detokenize", json_body={"model": t.model,
                                                                  "tokens": ids})
        text = resp.json().get("prompt")
        expect(isinstance(text, str), "POST /detokenize", resp.text)
        check_same("POST /detokenize", text,
                   None if tokenizer is None else tokenizer.decode(ids), "prompt", tokenizer)
        return text

    async def tokenize() -> None:
        # RemoteInferenceClient.tokenize without a tokenizer: {model, prompt,
        # add_special_tokens} -> tokens
        resp = await t.send(tok, "POST", "/tokenize", json_body={
            "model": t.model, "prompt": TEXT, "add_special_tokens": True})
        tokens = resp.json().get("tokens")
        expect(bool(tokens), "POST /tokenize", resp.text)
        check_same("POST /tokenize", tokens,
                   None if tokenizer is None else tokenizer(TEXT)["input_ids"], "tokens",
                   tokenizer)

    async def generate_bare() -> None:
        # RemoteInferenceClient.generate without a tokenizer: each result's response_ids
        # through /detokenize
        resp = await t.send(tok, "POST", "/inference/v1/generate",
                            json_body=body(SHORT_TOKENS), headers=headers)
        choice = resp.json()["choices"][0]
        check_choice(GEN, choice)
        await detokenize(choice["token_ids"])

    async def detokenize_prompt() -> None:
        await detokenize(PROMPT_IDS)

    return [(main, "generate", generate), (main, "sample", sample),
            (main, "get_world_size", world_size),
            *[(main, f"pause {m}", lambda m=m: pause(m)) for m in ("keep", "abort", "wait")],
            (main, "reset_prefix_cache", reset_prefix_cache), (main, "completion", passthrough),
            (tok, "tokenize", tokenize), (tok, "detokenize", detokenize_prompt),
            (tok, "generate", generate_bare)]


def real_steps(t: Target, mod: Any, main: Row, tok: Row, tokenizer: Any
               ) -> tuple[Steps, Callable[[], Awaitable[None]]]:
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
    # setup.py::build_new_inference_client with external_proxy_url only: one server is proxy
    # and control plane; the trainer passes its tokenizer (so generate() does not call
    # /detokenize); skyrl serve and Tinker-style callers build the client without one
    client = mod.RemoteInferenceClient(proxy_url=t.url, server_urls=[t.url],
                                       data_parallel_size=1, model_name=t.model,
                                       tokenizer=tokenizer)
    bare = mod.RemoteInferenceClient(proxy_url=t.url, server_urls=[t.url],
                                     data_parallel_size=1, model_name=t.model)
    gen_client = mod.RemoteGenerateClient(proxy_url=t.url)

    async def generate() -> None:
        result = await traced(main, GEN, gen_client.generate(
            prompt_token_ids=PROMPT_IDS, sampling_params=sampling(SHORT_TOKENS),
            session_id="session-0", model=t.model))
        check_choice(GEN, result.raw_response["choices"][0])
        expect(result.response_logprobs is not None
               and len(result.response_logprobs) == len(result.response_ids), GEN,
               "response_logprobs do not match response_ids")
        if tokenizer is not None:  # the trainer's path: RemoteInferenceClient.generate
            out = await traced(main, GEN, client.generate({
                "prompt_token_ids": [PROMPT_IDS], "sampling_params": sampling(SHORT_TOKENS),
                "session_ids": ["session-1"]}))
            expect(out["stop_reasons"][0] in ("stop", "length") and out["responses"][0]
                   is not None, GEN, f"stop_reasons {out['stop_reasons']}")

    async def sample() -> None:
        out = await traced(main, GEN, client.sample({"json": {
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT_IDS}]},
            "num_samples": 2, "sampling_params": {"temperature": 1.0, "max_tokens": 8, "seed": 1},
            "include_prompt_logprobs": True, "topk_prompt_logprobs": 2}}))
        expect(len(out["sequences"]) == 2 and all(
            len(s["tokens"]) == len(s["logprobs"] or []) > 0 for s in out["sequences"]), GEN,
            f"sequences {short(json.dumps(out['sequences']), 120)}")
        expect(out["prompt_logprobs"] is not None and out["prompt_logprobs"][0] is None
               and all(isinstance(v, float) for v in out["prompt_logprobs"][1:]), GEN,
               f"prompt_logprobs {out['prompt_logprobs']}")

    async def world_size() -> None:
        total, per_server = await traced(main, "GET /get_world_size", client.get_world_size())
        expect(total >= 1 and per_server >= 1, "GET /get_world_size", f"{total}, {per_server}")

    async def pause(mode: str) -> None:
        long = t.long_tokens
        task = asyncio.ensure_future(gen_client.generate(
            prompt_token_ids=PROMPT_IDS, sampling_params=sampling(long, ignore_eos=True),
            session_id=None, model=t.model))
        await t.in_flight(task)
        label = f"POST /pause?mode={mode}&clear_cache=false"
        try:
            await traced(main, label, client.pause(mode))
            if mode == "keep":
                await asyncio.sleep(0.5)
                expect(not task.done(), label, "the kept request finished while paused")
        finally:
            await traced(main, "POST /resume", client.resume())
            result = await traced(main, GEN, task)
        if mode == "abort":
            check_partial(f"{GEN} under {label}", result.response_ids, result.response_logprobs,
                          result.stop_reason, long)
        else:
            check_choice(f"{GEN} under {label}", result.raw_response["choices"][0],
                         wanted=long)

    async def reset_prefix_cache() -> None:
        answers = await traced(main, "POST /reset_prefix_cache", client.reset_prefix_cache())
        expect(all("success" in (a["body"] or {}) for a in answers.values()),
               "POST /reset_prefix_cache", str(answers))

    async def passthrough() -> None:
        out = await traced(main, "POST /v1/completions", client.completion({"json": {
            "prompt": PROMPT_IDS, "max_tokens": 8, "logprobs": 1, "return_token_ids": True}}))
        expect(len(out["choices"][0].get("token_ids") or []) == 8, "POST /v1/completions",
               "no token_ids")
        await traced(main, "POST /v1/chat/completions", client.chat_completion({"json": {
            "messages": [{"role": "user", "content": TEXT}], "max_tokens": 8}}))

    async def tokenize() -> None:
        ids = await traced(tok, "POST /tokenize", bare.tokenize([TEXT]))
        expect(bool(ids and ids[0]), "POST /tokenize", str(ids))
        local = await client.tokenize([TEXT]) if tokenizer is not None else None
        check_same("POST /tokenize", ids, local, "tokens", tokenizer)

    async def detokenize() -> None:
        texts = await traced(tok, "POST /detokenize", bare.detokenize([PROMPT_IDS]))
        expect(isinstance(texts[0], str), "POST /detokenize", str(texts))
        local = await client.detokenize([PROMPT_IDS]) if tokenizer is not None else None
        check_same("POST /detokenize", texts, local, "texts", tokenizer)

    async def generate_bare() -> None:
        tok.call(GEN)
        tok.call("POST /detokenize")
        try:
            out = await bare.generate({"prompt_token_ids": [PROMPT_IDS],
                                       "sampling_params": sampling(SHORT_TOKENS)})
        except Exception as exc:
            raise failed_call(exc, f"{GEN}, POST /detokenize") from exc
        expect(out["stop_reasons"][0] in ("stop", "length") and bool(out["response_ids"][0]),
               GEN, f"stop_reasons {out['stop_reasons']}, response_ids {out['response_ids']}")
        local = (await client.detokenize(out["response_ids"])) if tokenizer is not None else None
        check_same("POST /detokenize", out["responses"], local, "responses", tokenizer)

    async def close() -> None:
        for closing in (client, bare):
            await closing.teardown()
        await gen_client.aclose()

    return [(main, "generate", generate), (main, "sample", sample),
            (main, "get_world_size", world_size),
            *[(main, f"pause {m}", lambda m=m: pause(m)) for m in ("keep", "abort", "wait")],
            (main, "reset_prefix_cache", reset_prefix_cache), (main, "completion", passthrough),
            (tok, "tokenize", tokenize), (tok, "detokenize", detokenize),
            (tok, "generate", generate_bare)], close
