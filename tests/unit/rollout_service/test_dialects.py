"""The dialects' translations, without an engine: one sampling meaning whichever dialect
a request came through, acceptance that survives SGLang's field names, the pause held
by clients and pushes, the body keys that pick ``/generate``'s dialect, and vLLM's rule
for fields outside a message.
"""

from __future__ import annotations

import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from rollout_service.api.dialects.sglang import protocol as sgl
from rollout_service.api.dialects.sglang.router import generate_dialect
from rollout_service.api.dialects.sglang.serving import sampling_options, spec_fields
from rollout_service.api.dialects.vllm import protocol as vllm
from rollout_service.api.dialects.vllm.serving import token_logprobs
from rollout_service.engines.sequences import PositionLogprobs, TokenLogprob
from rollout_service.engines.sglang.stats import spec_stats_from_meta_info
from rollout_service.logprob_views import TokenNames, completion_logprobs, prompt_logprobs
from rollout_service.pausing import PauseGate
from rollout_service.protocol import openai
from rollout_service.protocol.acceptance import SpecDecodeStats
from rollout_service.protocol.vllm_sampling import ignore_extra_fields
from rollout_service.sampling import speculative_decoding_metrics, vllm_sampling_options


def vllm_options(fields: dict) -> object:
    req = openai.CompletionRequest.model_validate({"prompt": "a", **fields})
    return vllm_sampling_options(req, max_tokens=req.max_tokens, temperature=req.temperature,
                                 top_p=req.top_p, seed=req.seed, stop=req.stop,
                                 logprobs=req.logprobs)


def test_the_same_fields_sample_the_same_in_vllms_and_sglangs_names() -> None:
    ours = vllm_options({
        "max_tokens": 9, "min_tokens": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 5,
        "seed": 3, "stop": ["x"], "stop_token_ids": [4], "include_stop_str_in_output": True,
        "ignore_eos": True, "repetition_penalty": 1.1, "presence_penalty": 0.2,
        "frequency_penalty": 0.3, "skip_special_tokens": False,
        "spaces_between_special_tokens": False, "logprobs": 2})
    theirs = sampling_options(sgl.SGLangSamplingParams.model_validate({
        "max_new_tokens": 9, "min_new_tokens": 2, "temperature": 0.7, "top_p": 0.9,
        "top_k": 5, "sampling_seed": 3, "stop": ["x"], "stop_token_ids": [4],
        "no_stop_trim": True, "ignore_eos": True, "repetition_penalty": 1.1,
        "presence_penalty": 0.2, "frequency_penalty": 0.3, "skip_special_tokens": False,
        "spaces_between_special_tokens": False}), seed_offset=0, logprobs=2,
        prompt_logprobs=None)
    assert ours == theirs


def test_defaults_are_each_engines_own() -> None:
    """vLLM: 16 tokens, top-k all; SGLang: 128 new tokens, top-k -1 (all)."""
    assert vllm_options({}).max_tokens == 16 and vllm_options({"top_k": -1}).top_k == 0
    sglang = sampling_options(sgl.SGLangSamplingParams(), seed_offset=0, logprobs=None,
                              prompt_logprobs=None)
    assert (sglang.max_tokens, sglang.top_k, sglang.temperature) == (128, 0, 1.0)


@given(num_drafts=st.integers(0, 50), k=st.integers(1, 4), data=st.data())
def test_sglang_names_read_back_to_the_exported_counts(num_drafts: int, k: int,
                                                       data: st.DataObject) -> None:
    """What the SGLang dialect writes, the SGLang engine adapter's reader (written against
    SGLang's own meta_info) reads back exactly: slime logs the counts Prometheus has."""
    histogram = [0] * (k + 1)
    for _ in range(num_drafts):
        histogram[data.draw(st.integers(0, k))] += 1
    stats = SpecDecodeStats.from_histogram(histogram, num_drafts * k)
    meta = {"completion_tokens": num_drafts * 2 + 1, **spec_fields(stats, num_drafts * 2 + 1)}
    back = spec_stats_from_meta_info(meta, k + 1)
    assert back is not None
    assert (back.num_drafts, back.num_draft_tokens, back.num_accepted_tokens,
            back.accepted_per_position) == (stats.num_drafts, stats.num_draft_tokens,
                                            stats.num_accepted_tokens,
                                            stats.accepted_per_position)
    vllm_metrics = speculative_decoding_metrics(stats, k)
    assert vllm_metrics.acceptance_histogram == histogram
    assert meta["spec_correct_drafts_histogram"] == histogram


def test_logprobs_in_vllms_orders() -> None:
    """The sampled token first among a position's candidates, then the most likely; -inf
    as -9999 (vLLM's ``_create_completion_logprobs`` and ``_create_tokens_logprobs``)."""
    sampled_third = PositionLogprobs(TokenLogprob(7, -2.0, 3), (
        TokenLogprob(5, -0.5, 1), TokenLogprob(6, -1.0, 2)))
    sampled_first = PositionLogprobs(TokenLogprob(5, float("-inf"), 1), (
        TokenLogprob(5, float("-inf"), 1), TokenLogprob(6, -1.0, 2)))
    names = TokenNames(lambda ids: None, as_token_ids=True)  # type: ignore[arg-type]
    legacy = completion_logprobs([sampled_third, sampled_first], names, num_top=2)
    assert legacy.tokens == ["token_id:7", "token_id:5"]
    assert legacy.token_logprobs == [-2.0, -9999.0]
    assert [list(d) for d in legacy.top_logprobs] == [
        ["token_id:7", "token_id:5", "token_id:6"], ["token_id:5", "token_id:6"]]
    generate = token_logprobs([sampled_third], num_top=1).content[0]
    assert [c.token_id for c in generate.top_logprobs] == [7, 5]
    assert prompt_logprobs([None, sampled_third], names)[1][7].rank == 3


async def test_token_names_decode_each_id_once_per_call() -> None:
    calls: list[list[int]] = []

    async def decode(ids: list[int]) -> list[str]:
        calls.append(list(ids))
        return [f"<{i}>" for i in ids]

    names = TokenNames(decode, as_token_ids=False)
    position = PositionLogprobs(TokenLogprob(3, -1.0), (TokenLogprob(4, -0.5),))
    await names.learn([[position]], [9])
    await names.learn([[position, None]])
    assert calls == [[3, 4, 9]]
    assert (names[3], names[9]) == ("<3>", "<9>")


class FakeEngine:
    """FAKE engine pause: records the calls the gate makes."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def pause(self, mode: str = "wait") -> int:
        self.calls.append(f"pause {mode}")
        return 1

    async def resume(self) -> None:
        self.calls.append("resume")


async def test_a_push_inside_a_client_pause_leaves_generation_paused() -> None:
    engine = FakeEngine()
    gate = PauseGate(engine)  # type: ignore[arg-type]
    assert await gate.hold("client", "keep") == 1
    assert await gate.hold("push", "wait") == 0   # already paused: nothing changes
    assert not await gate.release("push")
    assert gate.is_paused and gate.mode == "keep"
    assert await gate.release("client")
    assert engine.calls == ["pause keep", "resume"]


async def test_abort_while_paused_aborts_and_a_stray_release_resumes_nothing() -> None:
    engine = FakeEngine()
    gate = PauseGate(engine)  # type: ignore[arg-type]
    assert not await gate.release("client")
    await gate.hold("push", "keep")
    await gate.hold("client", "abort")
    await gate.hold("client", "keep")   # the client again: no change
    assert not await gate.release("client")   # the push still holds it
    assert await gate.release("push")
    assert engine.calls == ["pause keep", "pause abort", "resume"]


@pytest.mark.parametrize(("body", "dialect"), [
    ({"prompt": "a"}, "native"), ({"prompt_token_ids": [1], "n": 2}, "native"),
    ({"text": "a"}, "sglang"), ({"input_ids": [1]}, "sglang"),
    ({"sampling_params": {}}, "sglang"), ({}, "native"), ([1, 2], "native"),
    ({"prompt": "a", "text": "b"}, "sglang")])
def test_generates_dialect_is_the_bodys_keys(body: object, dialect: str) -> None:
    assert generate_dialect(body) == dialect


def test_unknown_fields_are_warned_about_once_and_refused_ones_name_themselves(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            ignore_extra_fields({"a_new_field_xyz": 1}, "Test")
    assert sum("a_new_field_xyz" in r.message for r in caplog.records) == 1
    with pytest.raises(ValueError, match="^use_beam_search: True is not supported"):
        ignore_extra_fields({"use_beam_search": True}, "Test")
    ignore_extra_fields({"use_beam_search": False, "best_of": 1, "logit_bias": None}, "Test")
    with pytest.raises(ValidationError, match="regex"):
        sgl.GenerateReqInput.model_validate({"text": "a", "sampling_params": {"regex": "x"}})
    with pytest.raises(ValidationError, match="features: multimodal"):
        vllm.TokensRequest.model_validate({"token_ids": [1], "features": {"mm_hashes": {}}})
