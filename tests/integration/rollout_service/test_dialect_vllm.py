"""vLLM's rollout dialect on the real service (vLLM CPU engine, MTP on), as the RL
frameworks' clients speak it: token-in/token-out generation, vLLM's OpenAI extensions,
tokenization, the field rules, and vLLM's own benchmark client (pause, resume and abort
mid-generation: ``test_dialect_vllm_control.py``).

Request shapes are the clients' own (cited per test); responses are read with vLLM's own
pydantic types (vllm-project/vllm 0.32, installed here), so a field vLLM's clients need
that the service left out or shaped differently fails the test.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest
from vllm.entrypoints.openai.completion.protocol import (
    CompletionResponse,
    CompletionStreamResponse,
)
from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
    GenerateTokensResponse,
    GenerateTokensStreamResponse,
)

from rollout_service.protocol.sse import read_events
from rollout_service.tools.launch import ServiceProcess
from tests.integration.conftest import API_KEY, NUM_SPECULATIVE_TOKENS
from tests.support.tokens_stream import MODEL, PROMPT_IDS


@pytest.fixture
async def http(service: ServiceProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=service.url, timeout=120,
                                 headers={"authorization": f"Bearer {API_KEY}"}) as client:
        yield client


async def test_token_in_token_out_as_skyrl_sends_it(http: httpx.AsyncClient) -> None:
    """SkyRL 0.4.0 ``RemoteGenerateClient.generate``
    (``skyrl/backends/skyrl_train/inference_servers/remote_inference_client.py``): token
    ids and vLLM's sampling params in, ``choices[0].token_ids``, ``logprobs.content[].
    logprob`` and ``finish_reason`` out."""
    response = await http.post("/inference/v1/generate", headers={"X-Session-ID": "s1"}, json={
        "token_ids": PROMPT_IDS, "model": MODEL, "sampling_params": {
            "min_tokens": 2, "skip_special_tokens": True, "include_stop_str_in_output": False,
            "max_tokens": 8, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
            "logprobs": 2, "stop": None, "seed": 3}})
    assert response.status_code == 200, response.text
    answer = GenerateTokensResponse.model_validate(response.json())
    [choice] = answer.choices
    assert len(choice.token_ids) == len(choice.logprobs.content) >= 2
    assert all(c.token_id == t and c.logprob <= 0 and 1 <= len(c.top_logprobs) <= 3
               for c, t in zip(choice.logprobs.content, choice.token_ids))
    assert choice.finish_reason in ("stop", "length")
    assert answer.usage.prompt_tokens == len(PROMPT_IDS)
    assert answer.usage.completion_tokens == len(choice.token_ids)
    spec = answer.metrics.speculative_decoding
    assert spec.num_spec_tokens == NUM_SPECULATIVE_TOKENS
    assert len(spec.acceptance_histogram) == NUM_SPECULATIVE_TOKENS + 1
    assert sum(spec.acceptance_histogram) == spec.num_spec_steps
    ours = response.json()["choices"][0]["spec_decode"]
    assert (ours["num_draft_tokens"], ours["num_accepted_tokens"]) == (
        spec.num_draft_tokens, spec.num_accepted_draft_tokens)


async def test_the_same_seed_answers_the_same_through_tokens_and_completions(
        http: httpx.AsyncClient) -> None:
    """One translation of vLLM's sampling fields for every vLLM-shaped route."""
    sampling = {"max_tokens": 12, "temperature": 1.0, "seed": 7, "repetition_penalty": 1.2,
                "min_tokens": 4, "stop_token_ids": [3]}
    tokens = await http.post("/inference/v1/generate", json={
        "token_ids": PROMPT_IDS, "sampling_params": sampling, "return_token_ids": True})
    completion = await http.post("/v1/completions", json={
        "prompt": PROMPT_IDS, "return_token_ids": True, **sampling})
    assert tokens.status_code == completion.status_code == 200, (tokens.text, completion.text)
    assert (tokens.json()["choices"][0]["token_ids"]
            == completion.json()["choices"][0]["token_ids"])
    assert tokens.json()["prompt_token_ids"] == PROMPT_IDS


async def test_a_stream_says_what_the_whole_answer_says(http: httpx.AsyncClient) -> None:
    body = {"token_ids": PROMPT_IDS, "return_token_ids": True, "stream": True,
            "stream_options": {"include_usage": True},
            "sampling_params": {"max_tokens": 16, "temperature": 1.0, "seed": 5, "n": 2,
                                "logprobs": 1}}
    whole = GenerateTokensResponse.model_validate(
        (await http.post("/inference/v1/generate", json={**body, "stream": False})).json())
    ids: dict[int, list[int]] = {0: [], 1: []}
    finished, chunks = {}, []
    async with http.stream("POST", "/inference/v1/generate", json=body) as response:
        assert response.status_code == 200
        async for event in read_events(response.aiter_lines()):
            chunk = GenerateTokensStreamResponse.model_validate_json(event)
            chunks.append(chunk)
            for choice in chunk.choices:
                assert choice.index not in finished, "nothing after a choice's last chunk"
                ids[choice.index] += choice.token_ids
                assert len(choice.logprobs.content) == len(choice.token_ids)
                if choice.finish_reason is not None:
                    finished[choice.index] = choice
    assert chunks[0].prompt_token_ids == PROMPT_IDS
    assert all(c.prompt_token_ids is None for c in chunks[1:])
    assert [ids[0], ids[1]] == [c.token_ids for c in whole.choices]
    assert all(f.weight_versions for f in finished.values())
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


async def test_completions_take_vllms_extensions_and_answer_in_vllms_shape(
        http: httpx.AsyncClient) -> None:
    """AReaL 1.0.4's vLLM backend (``areal/engine/vllm_remote.py``,
    ``build_generation_request``): token-id prompt, no ``model``, vLLM's fields, legacy
    logprobs with tokens as ``token_id:N``."""
    response = await http.post("/v1/completions", json={
        "prompt": PROMPT_IDS, "top_p": 1.0, "top_k": -1, "max_tokens": 6, "temperature": 1.0,
        "stop_token_ids": [], "ignore_eos": True, "skip_special_tokens": False,
        "return_tokens_as_token_ids": True, "logprobs": 0, "use_beam_search": False,
        "stream": False, "prompt_logprobs": 1})
    assert response.status_code == 200, response.text
    answer = CompletionResponse.model_validate(response.json())
    [choice] = answer.choices
    assert choice.finish_reason == "length"
    tokens = choice.logprobs.tokens
    assert len(tokens) == 6 and all(t.startswith("token_id:") for t in tokens)
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    prompt = response.json()["choices"][0]["prompt_logprobs"]
    assert prompt[0] is None and len(prompt) == len(PROMPT_IDS)
    assert all(str(t) in p for t, p in zip(PROMPT_IDS[1:], prompt[1:]))


async def test_echo_scores_a_prompt_as_areals_teacher_asks(http: httpx.AsyncClient) -> None:
    """AReaL's vLLM backend ``build_score_request`` / ``parse_score_response``
    (``areal/engine/vllm_remote.py``): ``echo`` with prompt logprobs; the prompt's token is
    the first entry of each position, and the prompt leads the text and the logprobs."""
    response = await http.post("/v1/completions", json={
        "prompt": PROMPT_IDS, "max_tokens": 1, "temperature": 0.0, "logprobs": 1,
        "prompt_logprobs": 1, "echo": True})
    assert response.status_code == 200, response.text
    [choice] = response.json()["choices"]
    prompt = choice["prompt_logprobs"]
    assert len(prompt) == len(PROMPT_IDS) and not prompt[0]
    assert [int(next(iter(p))) for p in prompt[1:]] == PROMPT_IDS[1:]
    scores = [next(iter(p.values()))["logprob"] for p in prompt[-3:]]
    assert all(s <= 0 for s in scores)
    decoded = (await http.post("/detokenize", json={"tokens": PROMPT_IDS})).json()["prompt"]
    assert choice["text"].startswith(decoded)
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(PROMPT_IDS) + 1
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:len(PROMPT_IDS)] == [
        p[str(t)]["logprob"] for p, t in zip(prompt[1:], PROMPT_IDS[1:])]


async def test_streamed_completions_as_vllms_benchmark_reads_them(
        http: httpx.AsyncClient) -> None:
    """vLLM's ``vllm/benchmarks/lib/endpoint_request_func.py``
    (``async_request_openai_completions``): the fields it sends, chunks it parses."""
    body = {"model": MODEL, "prompt": "1 + 1 =", "repetition_penalty": 1.0, "max_tokens": 8,
            "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True, "temperature": 0.0}
    chunks = []
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for event in read_events(response.aiter_lines()):
            chunks.append(CompletionStreamResponse.model_validate_json(event))
    assert chunks[-1].usage.completion_tokens == 8
    assert "".join(c.text for chunk in chunks for c in chunk.choices)


async def test_model_unknown_is_404_and_unknown_fields_are_ignored(
        http: httpx.AsyncClient, service: ServiceProcess) -> None:
    unknown = await http.post("/v1/completions", json={"model": "gpt-4", "prompt": "a"})
    assert unknown.status_code == 404
    assert unknown.json()["error"]["message"] == "The model `gpt-4` does not exist."
    tokens = await http.post("/inference/v1/generate", json={
        "token_ids": [1], "model": "gpt-4", "sampling_params": {"max_tokens": 1}})
    assert tokens.status_code == 404
    ignored = await http.post("/v1/completions", json={
        "prompt": "a", "max_tokens": 1, "a_field_from_vllm_0_40": {"x": 1},
        "cache_salt": "abc", "priority": 0})
    assert ignored.status_code == 200, ignored.text
    assert "a_field_from_vllm_0_40" in service.log_path.read_text()


@pytest.mark.parametrize(("field", "value"), [
    ("use_beam_search", True), ("logit_bias", {"5": 2.0}),
    ("response_format", {"type": "json_object"}), ("allowed_token_ids", [1, 2])])
async def test_a_field_that_would_change_sampling_is_refused_naming_it(
        http: httpx.AsyncClient, field: str, value: object) -> None:
    response = await http.post("/v1/completions", json={"prompt": "a", field: value})
    assert response.status_code == 400
    assert field in response.json()["error"]["message"]
    tokens = await http.post("/inference/v1/generate", json={
        "token_ids": [1], "sampling_params": {field: value}})
    assert tokens.status_code == 400 and field in tokens.text


async def test_min_p_is_refused_as_vllm_refuses_it_with_speculative_decoding(
        http: httpx.AsyncClient) -> None:
    """Honoured, never dropped: vLLM 0.32 itself refuses ``min_p`` with a drafter."""
    response = await http.post("/v1/completions", json={"prompt": "a", "min_p": 0.1})
    assert response.status_code == 400 and "min_p" in response.text


async def test_tokenize_and_detokenize_as_skyrl_calls_them(http: httpx.AsyncClient) -> None:
    """SkyRL's ``RemoteInferenceClient.tokenize`` / ``detokenize`` without a local
    tokenizer: one call per text, vLLM's shapes
    (``vllm/entrypoints/serve/tokenize/protocol.py``)."""
    tokens = await http.post("/tokenize", json={"model": MODEL, "prompt": "1 + 1 =",
                                                "add_special_tokens": True,
                                                "return_token_strs": True})
    answer = tokens.json()
    assert answer["count"] == len(answer["tokens"]) > 0 and answer["max_model_len"] == 1024
    assert "".join(answer["token_strs"]) == "1 + 1 ="
    text = await http.post("/detokenize", json={"model": MODEL, "tokens": answer["tokens"]})
    assert text.json() == {"prompt": "1 + 1 ="}
    # the ids a text prompt generates from: the same through /v1/completions
    completion = await http.post("/v1/completions", json={
        "prompt": "1 + 1 =", "max_tokens": 1, "return_token_ids": True})
    assert completion.json()["choices"][0]["prompt_token_ids"] == answer["tokens"]
    chat = await http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and chat.json()["count"] > 0
    assert (await http.post("/detokenize", json={"tokens": [10**6]})).status_code == 400
    assert (await http.post("/tokenize", json={"model": "x", "prompt": "a"})).status_code == 404


async def test_world_size_prefix_cache_and_weight_info(http: httpx.AsyncClient) -> None:
    assert (await http.get("/get_world_size")).json() == {"world_size": 1}
    assert (await http.post("/reset_prefix_cache")).json() == {"success": True}
    info = (await http.get("/weight_info")).json()
    status = (await http.get("/health")).json()["weights"]
    expected = status["main_version"]
    assert info == {"weight_version": "default" if expected is None else str(expected)}


async def test_control_routes_take_the_api_key(service: ServiceProcess) -> None:
    async with httpx.AsyncClient(base_url=service.url, timeout=30) as anonymous:
        for method, path in (("POST", "/pause"), ("POST", "/abort_requests"),
                             ("POST", "/inference/v1/generate")):
            assert (await anonymous.request(method, path, json={})).status_code == 401


def test_vllm_benchmark_client_fails_no_request(service: ServiceProcess, tmp_path) -> None:
    """vLLM's own benchmark client (``vllm/benchmarks/serve.py``, backend ``openai`` and
    ``openai-chat``) against the service: every request completes."""
    import subprocess
    import sys

    from rollout_service.embedded import ensure_model

    script = ("import sys\n"
              "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
              "from vllm.benchmarks.serve import add_cli_args, main\n"
              "parser = FlexibleArgumentParser(); add_cli_args(parser)\n"
              "main(parser.parse_args(sys.argv[1:]))\n")
    for backend, endpoint in (("openai", "/v1/completions"),
                              ("openai-chat", "/v1/chat/completions")):
        name = f"{backend}.json"
        run = subprocess.run(
            [sys.executable, "-c", script, "--backend", backend, "--base-url", service.url,
             "--endpoint", endpoint, "--model", MODEL, "--tokenizer", str(ensure_model("tiny")),
             "--dataset-name", "random", "--random-input-len", "16", "--random-output-len",
             "16", "--num-prompts", "24", "--max-concurrency", "8", "--save-result",
             "--result-dir", str(tmp_path), "--result-filename", name],
            env={**__import__("os").environ, "OPENAI_API_KEY": API_KEY},
            capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        result = json.loads((tmp_path / name).read_text())
        assert (result["completed"], result["failed"]) == (24, 0), result.get("errors")
