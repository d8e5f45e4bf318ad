"""SGLang engine against the FAKE SGLang server (``fake_sglang``): generation, pauses,
streams and chat. SGLang cannot serve here.

Everything below runs against the fake, in this process, over httpx's ASGI transport;
nothing here has run against a live SGLang server. Covered: ``/generate`` with token ids
and with text (0.5.23 takes the text, older servers get ``/v1/tokenize``'d ids), finish
reasons, the three pause modes and what each does to requests in flight, prompts refused
before and by the server, streams (cumulative events and deltas) merging into the whole
answer, and the chat prompt from the checkpoint's template. The other modules on the fake:
``test_sglang_stats.py``, ``test_sglang_pushes.py``, ``test_sglang_server.py`` and the
opt-in ``test_sglang_conformance.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount

from rollout_service.embedded import ensure_model
from rollout_service.engines.base import (
    ChatTurn,
    EngineUnavailableError,
    InvalidRequestError,
    SamplingOptions,
)
from rollout_service.engines.sglang.answers import streamed_answers
from rollout_service.engines.sglang.engine import SGLangEngine
from rollout_service.engines.sglang.http_client import HttpxServer, Reply, Streamed
from tests.support.fake_sglang import FakeSGLang
from tests.support.sglang_on_fake import SPEC_ARGS, VERSIONS, connect, greedy, make_fake, sent
from tests.support.waiting import until


async def until_sent(fake: FakeSGLang, route: str, count: int = 1) -> None:
    """Until the fake has received ``count`` requests on ``route``."""
    async def calls() -> int:
        return len(sent(fake, route))

    await until(calls, lambda n: n >= count, timeout_s=30, interval_s=0.01)


# --- generation ---


@pytest.mark.parametrize("version", VERSIONS)
async def test_generate_with_token_ids(version: str, checkpoint: str) -> None:
    fake = make_fake(version, checkpoint)
    engine = await connect(fake)
    result = await engine.generate([5, 6, 7], greedy(4, seed=3, stop=("zz",), logprobs=0),
                                   "req-1")
    assert result.prompt_token_ids == (5, 6, 7)
    assert result.token_ids == (8, 9, 10, 11)
    assert result.text == "ijkl"
    assert result.finish_reason == "length"
    assert [p.token.logprob for p in result.logprobs] == [-0.25, -0.5, -0.75, -1.0]
    assert [p.token.token_id for p in result.logprobs] == [8, 9, 10, 11]
    [body] = sent(fake, "/generate")
    assert body == {"rid": "req-1", "input_ids": [5, 6, 7], "return_logprob": True,
                    "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "top_p": 1.0,
                                        "top_k": -1, "ignore_eos": False, "stop": ["zz"],
                                        "sampling_seed": 3}}


@pytest.mark.parametrize(("version", "route"), [("0.5.23", "/generate"),
                                                ("0.5.10", "/v1/tokenize")])
async def test_generate_with_text(version: str, route: str, checkpoint: str) -> None:
    """0.5.23 takes the text and returns its ids; older servers get /v1/tokenize'd ids."""
    fake = make_fake(version, checkpoint)
    engine = await connect(fake)
    result = await engine.generate("abc", greedy(2), "req-t")
    assert result.prompt_token_ids == tuple(fake.model.encode("abc"))
    assert result.token_ids == (result.prompt_token_ids[-1] + 1, result.prompt_token_ids[-1] + 2)
    [body] = sent(fake, "/generate")
    if version == "0.5.23":
        assert (body["text"], body["return_prompt_token_ids"]) == ("abc", True)
        assert "input_ids" not in body
    else:
        assert sent(fake, route) == [{"prompt": "abc"}]
        assert body["input_ids"] == fake.model.encode("abc") and "text" not in body


async def test_finish_reasons(checkpoint: str) -> None:
    fake = make_fake("0.5.23", checkpoint)
    engine = await connect(fake)
    by_eos = await engine.generate([60], greedy(10), "eos")
    assert (by_eos.finish_reason, by_eos.token_ids) == ("stop", (61, 62, 63))
    past_eos = await engine.generate([60], greedy(5, ignore_eos=True), "ignore-eos")
    assert (past_eos.finish_reason, past_eos.token_ids) == ("length", (61, 62, 63, 0, 1))
    by_stop = await engine.generate([0], greedy(10, stop=("de",)), "stop-str")
    assert (by_stop.finish_reason, by_stop.text, by_stop.token_ids) == ("stop", "bc", (1, 2, 3, 4))


async def generating(checkpoint: str, delay_s: float, request_id: str
                     ) -> tuple[FakeSGLang, SGLangEngine, asyncio.Task]:
    """An adapter on a fake 0.5.23 server whose generate answers after ``delay_s``, with
    one request that has reached the server."""
    fake = make_fake("0.5.23", checkpoint)
    fake.generate_delay_s = delay_s
    engine = await connect(fake)
    running = asyncio.create_task(engine.generate([1], greedy(4), request_id))
    await until_sent(fake, "/generate")
    return fake, engine, running


async def test_abort_pause_aborts_running_requests(checkpoint: str) -> None:
    fake, engine, running = await generating(checkpoint, 10.0, "aborted")
    await engine.pause("abort")
    result = await asyncio.wait_for(running, 5)
    assert (result.finish_reason, result.token_ids) == ("abort", ())
    assert sent(fake, "/pause_generation") == [{"mode": "abort"}]
    await engine.resume()


async def test_wait_pause_drains_and_holds_new_requests(checkpoint: str) -> None:
    fake, engine, running = await generating(checkpoint, 0.3, "drained")
    assert await engine.pause("wait") == 0  # drained: nothing held across the load
    assert running.done() and running.result().finish_reason == "length"
    assert sent(fake, "/pause_generation") == [{"mode": "retract"}]
    held = asyncio.create_task(engine.generate([1], greedy(4), "held"))
    await asyncio.sleep(0.05)  # a negative (nothing reaches the fake while paused): a slow
    # machine can only let this pass wrongly, never fail it
    assert not held.done() and len(sent(fake, "/generate")) == 1
    await engine.resume()
    assert (await asyncio.wait_for(held, 5)).finish_reason == "length"


async def test_keep_pause_holds_the_requests_in_flight(checkpoint: str) -> None:
    _, engine, running = await generating(checkpoint, 0.5, "held")
    assert await engine.pause("keep") == 1
    await engine.resume()
    assert (await asyncio.wait_for(running, 5)).finish_reason == "length"


async def test_keep_pause_retracts(checkpoint: str) -> None:
    fake = make_fake("0.5.10", checkpoint)
    engine = await connect(fake)
    await engine.pause("keep")
    await engine.resume()
    assert fake.routes_called()[-2:] == ["/pause_generation", "/continue_generation"]
    assert sent(fake, "/pause_generation") == [{"mode": "retract"}]


async def test_invalid_prompts(checkpoint: str) -> None:
    fake = make_fake("0.5.23", checkpoint, context_length=16)
    engine = await connect(fake)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        await engine.generate([64], greedy(1), "bad-id")
    with pytest.raises(InvalidRequestError, match="exceed the model's context length"):
        await engine.generate([1] * 10, greedy(7), "too-long")
    assert sent(fake, "/generate") == []
    with pytest.raises(InvalidRequestError, match="longer than the model's context length"):
        await engine.generate("a" * 20, greedy(1), "long-text")  # SGLang's own 400


# --- streaming and chat ---


async def streamed(engine: SGLangEngine, prompt: str | list[int], sampling: SamplingOptions,
                   rid: str) -> list:
    return [delta async for delta in engine.stream(prompt, sampling, rid)]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("is_incremental", [False, True])
async def test_a_stream_merges_into_the_whole_answer(version: str, is_incremental: bool,
                                                     checkpoint: str) -> None:
    """Cumulative events (SGLang's default) and deltas (incremental_streaming_output) alike."""
    fake = make_fake(version, checkpoint, incremental_streaming_output=is_incremental)
    fake.model.accept_per_step = 2
    engine = await connect(fake)
    sampling = greedy(10, seed=3, logprobs=0, ignore_eos=True)
    whole = await engine.generate([5, 6, 7], sampling, "whole")
    deltas = await streamed(engine, [5, 6, 7], sampling, "streamed")
    assert len(deltas) == 4  # prefill's token, then verify steps of 3 tokens
    assert [d.result is not None for d in deltas] == [False, False, False, True]
    assert "".join(d.text for d in deltas) == whole.text
    assert tuple(t for d in deltas for t in d.token_ids) == whole.token_ids
    assert deltas[-1].result == whole
    [body] = [b for b in sent(fake, "/generate") if b.get("stream")]
    assert body["input_ids"] == [5, 6, 7] and body["rid"] == "streamed"


async def test_a_stream_of_text_sends_its_tokens(checkpoint: str) -> None:
    fake = make_fake("0.5.23", checkpoint)
    engine = await connect(fake)
    deltas = await streamed(engine, "abc", greedy(2), "r")
    assert deltas[-1].result.prompt_token_ids == tuple(fake.model.encode("abc"))
    assert sent(fake, "/v1/tokenize") == [{"prompt": "abc"}]


async def test_a_refusal_inside_a_stream_is_an_invalid_request(checkpoint: str) -> None:
    """SGLang reports it as an error event under status 200."""
    engine = await connect(make_fake("0.5.23", checkpoint, context_length=8))
    engine.info = replace(engine.info, max_model_len=1000)  # past our own check
    with pytest.raises(InvalidRequestError, match="longer than the model's context length"):
        await streamed(engine, list(range(20)), greedy(2), "r")


async def test_chat_prompt_is_the_checkpoints_template(checkpoint: str) -> None:
    from transformers import AutoTokenizer

    model = str(ensure_model("tiny"))
    engine = await connect(FakeSGLang("0.5.23", model_path=model, speculative=SPEC_ARGS))
    ids = await engine.chat_prompt([ChatTurn(role="user", content="1 + 1 =")])
    assert AutoTokenizer.from_pretrained(model).decode(ids) == "user: 1 + 1 =\nassistant:"
    without = await connect(make_fake("0.5.23", checkpoint))  # config.json alone
    with pytest.raises(InvalidRequestError, match="^messages: .*no chat template"):
        await without.chat_prompt([ChatTurn(role="user", content="hi")])


async def test_a_server_under_a_path_prefix_is_reached_under_it(checkpoint: str) -> None:
    """An ``engine_url`` behind a proxy's path (``http://host/sglang``): start-up calls
    and generation, plain and streamed, all go to ``/sglang/...``."""
    fake = make_fake("0.5.23", checkpoint)
    proxy = Starlette(routes=[Mount("/sglang", app=fake.app)])
    http = HttpxServer(httpx.AsyncClient(transport=httpx.ASGITransport(app=proxy),
                                         base_url="http://proxy/sglang"))
    engine = await SGLangEngine.connect("http://proxy/sglang", served_model_name="tiny",
                                        http=http)
    result = await engine.generate([1, 2], greedy(4), "prefixed")
    deltas = [d async for d in engine.stream([1, 2], greedy(4), "prefixed-stream")]
    assert deltas[-1].result is not None
    assert deltas[-1].result.token_ids == result.token_ids and len(result.token_ids) == 4
    assert len(sent(fake, "/sglang/generate")) == 2  # the fake sees the whole path
    await engine.shutdown()


async def test_a_stream_event_that_is_not_json_is_the_servers_fault() -> None:
    """An event SGLang could not have meant (cut, or not JSON) ends the stream as the
    engine's failure (a 5xx to the client), naming what came, not as a crash of the
    service's handler."""

    async def lines() -> AsyncIterator[str]:
        for line in ('data: {"text": "a", "meta_info": {}}', "", 'data: {"text": "ab', ""):
            yield line

    async def read() -> Reply:
        raise AssertionError("a 200 stream is read line by line")

    answers = streamed_answers(Streamed(status=200, lines=lines(), read=read))
    assert (await anext(answers))["text"] == "a"
    with pytest.raises(EngineUnavailableError, match=r"not JSON: '\{\"text\": \"ab'"):
        await anext(answers)
