"""The HTTP messages: what requests accept is what their JSON Schema says, and OpenAI's
own client types read the responses and chunks (no engine)."""

from __future__ import annotations

import jsonschema
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import BaseModel, ValidationError

from rollout_service.api.dialects.sglang import protocol as sglang
from rollout_service.api.dialects.vllm import protocol as vllm
from rollout_service.protocol import messages, openai
from rollout_service.protocol.acceptance import summarize

SPEC = messages.SpecDecodeInfo(num_drafts=3, num_draft_tokens=6, num_accepted_tokens=2,
                               num_verify_steps=3, accepted_per_position=[2, 0],
                               accept_rate=1 / 3, accept_length=5 / 3)
USAGE = openai.CompletionUsage(prompt_tokens=3, completion_tokens=4, total_tokens=7)
ACCEPTANCE = summarize([SPEC.to_stats()])

GENERATE_BODIES = [
    ({"prompt": "1 + 1"}, True),
    ({"prompt_token_ids": [0, 5]}, True),
    ({"prompt_token_ids": [5], "prompt": None}, True),
    ({"prompt_token_ids": [5.0], "n": 2.0}, True),   # JSON's integers, as JSON Schema reads them
    ({}, False),
    ({"prompt": "a", "prompt_token_ids": [1]}, False),
    ({"prompt": None}, False),
    ({"prompt": ""}, False),
    ({"prompt_token_ids": []}, False),
    ({"prompt_token_ids": [-1]}, False),
    ({"prompt_token_ids": [1.5]}, False),
    ({"prompt_token_ids": ["1"]}, False),
    ({"prompt": "a", "max_tokens": "3"}, False),
    ({"prompt": "a", "ignore_eos": 1}, False),
    ({"prompt": "a", "stop": [""]}, False),
    ({"prompt": "a", "seed": 2**53}, False),
    ({"prompt": "a", "top_k": 2**31}, False),
    ({"prompt": "a", "temperature": 2.5}, False),
    ({"prompt": "a", "n": 65}, False),
    ({"prompt": "a", "max_token": 3}, False),
]
COMPLETION_BODIES = [
    ({"model": "m", "prompt": "a"}, True),
    ({"model": "m", "prompt": ["a", "b"]}, True),
    ({"model": "m", "prompt": [1, 2]}, True),
    ({"model": "m", "prompt": [[1], [2, 3]]}, True),
    ({"model": "m", "prompt": "a", "stream": True,
      "stream_options": {"include_usage": True}}, True),
    ({"model": "m", "prompt": "a", "echo": False, "logprobs": 0, "stop": "x"}, True),
    ({"model": "m", "prompt": []}, False),
    ({"model": "m", "prompt": [[]]}, False),
    ({"model": "m", "prompt": [""]}, False),
    ({"model": "m", "prompt": ["a", 1]}, False),
    ({"model": "m", "prompt": "a", "echo": True, "logprobs": 1}, True),
    ({"model": "m", "prompt": "a", "echo": 0}, False),
    ({"model": "m", "prompt": "a", "stop": ""}, False),
    # vLLM's rules: model optional, top-N logprobs, its sampling extensions, unknown
    # fields ignored, fields that would change sampling refused unless neutral.
    ({"prompt": "a"}, True),
    ({"model": "m", "prompt": "a", "logprobs": 5, "prompt_logprobs": 2}, True),
    ({"model": "m", "prompt": "a", "logprobs": 21}, False),
    ({"model": "m", "prompt": [1], "min_tokens": 2, "stop_token_ids": [3],
      "repetition_penalty": 1.1, "ignore_eos": True, "skip_special_tokens": False,
      "include_stop_str_in_output": True, "return_token_ids": True,
      "return_tokens_as_token_ids": True, "top_k": -1, "min_p": 0.0}, True),
    ({"model": "m", "prompt": "a", "min_tokens": -1}, False),
    ({"model": "m", "prompt": "a", "some_new_vllm_field": {"x": 1}}, True),
    ({"model": "m", "prompt": "a", "use_beam_search": False, "logit_bias": {}}, True),
    ({"model": "m", "prompt": "a", "use_beam_search": True}, False),
    ({"model": "m", "prompt": "a", "logit_bias": {"5": 1.0}}, False),
    ({"model": "m", "prompt": "a", "response_format": {"type": "json_object"}}, False),
]
CHAT_BODIES = [
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, True),
    ({"model": "m", "messages": [{"role": "system", "content": ""},
                                 {"role": "user", "content": [{"type": "text", "text": "a"}]}],
      "max_completion_tokens": 4}, True),
    ({"model": "m", "messages": []}, False),
    ({"model": "m", "messages": [{"role": "tool", "content": "x"}]}, False),
    ({"model": "m", "messages": [{"role": "user", "content": []}]}, False),
    ({"model": "m", "messages": [{"role": "user", "content": "a"}], "max_tokens": 0}, False),
    ({"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 3,
      "min_tokens": 1}, True),
    ({"model": "m", "messages": [{"role": "user", "content": "a"}], "top_logprobs": 21},
     False),
    ({"model": "m", "messages": [{"role": "user", "content": "a"}],
      "tools": [{"type": "function"}]}, False),
]
TOKENS_BODIES = [   # vLLM's POST /inference/v1/generate, as SkyRL's remote client sends it
    ({"token_ids": [1, 2], "sampling_params": {"max_tokens": 4, "temperature": 1.0,
                                              "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                                              "min_tokens": 0, "skip_special_tokens": True,
                                              "include_stop_str_in_output": False,
                                              "logprobs": 0, "stop": None},
      "model": "m", "cache_salt": "s"}, True),
    ({"token_ids": [1], "sampling_params": {"n": 2, "logprobs": 3}, "stream": True,
      "return_token_ids": True}, True),
    ({"token_ids": []}, False),
    ({"token_ids": [-1]}, False),
    ({"token_ids": [1], "sampling_params": {"logit_bias": {"1": 1.0}}}, False),
    ({"token_ids": [1], "features": {"mm_hashes": {}}}, False),
    ({"token_ids": [1], "output_mode": "pixels"}, False),
]
SGLANG_BODIES = [   # SGLang's POST /generate, as slime and AReaL send it
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0,
                                              "top_p": 1.0, "top_k": -1, "stop": ["x"],
                                              "stop_token_ids": [0], "no_stop_trim": True,
                                              "skip_special_tokens": False},
      "return_logprob": True, "return_routed_experts": False}, True),
    ({"text": ["a", "b"], "sampling_params": [{"n": 2}, {}], "rid": ["r1", "r2"],
      "return_logprob": [True, False], "top_logprobs_num": 2, "logprob_start_len": 0,
      "stream": True}, True),
    ({"input_ids": [[1], [2, 3]]}, True),
    ({"sampling_params": {}}, False),
    ({"text": "a", "input_ids": [1]}, False),
    ({"input_ids": []}, False),
    ({"text": "a", "sampling_params": {"json_schema": "{}"}}, False),
    ({"text": "a", "sampling_params": {"regex": None}}, True),
    ({"text": "a", "image_data": "x.png"}, False),
    ({"text": "a", "sampling_params": {"max_new_tokens": 0}}, False),
]
BEGIN = {"version": 1, "total_bytes": 2, "params": [{"name": "w", "shape": [1], "dtype": "bf16"}]}
PUSH_BODIES = [
    ({**BEGIN, "params": [{"name": "w", "shape": [1], "dtype": "bfloat16"}],
      "segment": "mtp-x", "segment_bytes": 4}, True),
    ({**BEGIN, "params": [{"name": "w", "shape": [1], "dtype": "bfloat16"}],
      "transport": "cuda_ipc"}, True),
    ({**BEGIN, "segment": "mtp-x", "segment_bytes": 4}, False),   # dtype not a tensor dtype
    ({**BEGIN, "params": [{"name": "w", "shape": [1], "dtype": "bfloat16"}],
      "segment": "mtp-x"}, False),   # shm needs segment_bytes
    ({**BEGIN, "params": [{"name": "w", "shape": [1], "dtype": "bfloat16"}],
      "transport": "cuda_ipc", "segment": "mtp-x"}, False),
    ({**BEGIN, "params": [{"name": "w", "shape": [-1], "dtype": "bfloat16"}],
      "segment": "mtp-x", "segment_bytes": 4}, False),
    ({**BEGIN, "params": [{"name": "w", "shape": [1], "dtype": "bfloat16"}],
      "transport": "nccl", "group_id": "g"}, True),
    ({**BEGIN, "params": [{"name": "w", "shape": [1], "dtype": "bfloat16"}],
      "transport": "nccl"}, False),   # nccl needs its group
    ({**BEGIN, "params": [{"name": "w", "shape": [1], "dtype": "bfloat16"}],
      "transport": "nccl", "group_id": "g", "broadcast_bytes": 64}, False),   # gone: buckets
    ({**BEGIN, "params": [{"name": "w", "shape": [1], "dtype": "bfloat16"}],
      "segment": "mtp-x", "segment_bytes": 4, "group_id": "g"}, False),   # not shm's
    ({**BEGIN, "params": [{"name": "w", "shape": [1], "dtype": "bfloat16"}],
      "transport": "nccl", "group_id": "g", "segment": "mtp-x"}, False),
]
UPDATE = {"push_id": "p", "tensors": [{"name": "w", "dtype": "bfloat16", "shape": [1],
                                       "location": {"transport": "nccl", "offset": 0}}]}
BUCKET = {"index": 0, "offset": 0, "nbytes": 64, "checksum": "00ff" * 4}
UPDATE_BODIES = [
    ({**UPDATE, "bucket": BUCKET}, True),
    ({"push_id": "p", "bucket": BUCKET}, True),   # a bucket that ends inside a tensor
    ({**UPDATE, "bucket": {**BUCKET, "nbytes": 12}}, False),   # not whole 8-byte words
    ({**UPDATE, "bucket": {**BUCKET, "checksum": "xyz"}}, False),
    ({**UPDATE, "bucket": {**BUCKET, "offset": -8}}, False),
    ({**UPDATE, "bucket": {**BUCKET, "extra": 1}}, False),
]
GROUP_BODIES = [
    ({"group_id": "t1", "master_address": "h", "master_port": 29500, "world_size": 3}, True),
    ({"group_id": "t1", "master_address": "h", "master_port": 29500, "world_size": 3,
      "rank_offset": 2, "backend": "gloo", "timeout_s": 5, "lease_s": 60,
      "bucket_bytes": 1024, "num_buckets": 2}, True),
    ({"group_id": "t1", "master_address": "h", "master_port": 0, "world_size": 3}, False),
    ({"group_id": "t1", "master_address": "h", "master_port": 1, "world_size": 3,
      "num_buckets": 0}, False),
    ({"master_address": "h", "master_port": 1, "world_size": 3}, False),
]


def schema_accepts(model: type[BaseModel], body: object) -> bool:
    return jsonschema.Draft202012Validator(model.model_json_schema()).is_valid(body)


def model_accepts(model: type[BaseModel], body: object) -> bool:
    try:
        model.model_validate(body)
    except ValidationError:
        return False
    return True


@pytest.mark.parametrize("model,body,is_valid", [
    *((messages.GenerateRequest, b, v) for b, v in GENERATE_BODIES),
    *((openai.CompletionRequest, b, v) for b, v in COMPLETION_BODIES),
    *((openai.ChatCompletionRequest, b, v) for b, v in CHAT_BODIES),
    *((vllm.TokensRequest, b, v) for b, v in TOKENS_BODIES),
    *((sglang.GenerateReqInput, b, v) for b, v in SGLANG_BODIES),
    *((messages.PushBeginRequest, b, v) for b, v in PUSH_BODIES),
    *((messages.PushUpdateRequest, b, v) for b, v in UPDATE_BODIES),
    *((messages.WeightGroupRequest, b, v) for b, v in GROUP_BODIES),
])
def test_a_request_is_valid_exactly_when_its_json_schema_says_so(
        model: type[BaseModel], body: dict, is_valid: bool) -> None:
    assert model_accepts(model, body) == is_valid
    assert schema_accepts(model, body) == is_valid


def test_chat_message_parts_are_joined() -> None:
    message = openai.ChatMessage(role="user", content=[
        openai.ChatTextPart(type="text", text="1 + "), openai.ChatTextPart(type="text", text="1")])
    assert message.text == "1 + 1"


def test_responses_read_as_openai_types() -> None:
    completion = openai.CompletionResponse(
        id="cmpl-1", created=1, model="m", usage=USAGE, acceptance=ACCEPTANCE,
        choices=[openai.CompletionChoice(index=0, text="2", finish_reason="length",
                                         spec_decode=SPEC)])
    parsed = Completion.model_validate(completion.model_dump(mode="json"))
    assert parsed.choices[0].text == "2" and parsed.usage.total_tokens == 7
    assert parsed.choices[0].model_extra["spec_decode"]["num_drafts"] == 3

    chat = openai.ChatCompletionResponse(
        id="chatcmpl-1", created=1, model="m", usage=USAGE, acceptance=ACCEPTANCE,
        choices=[openai.ChatChoice(index=0, message=openai.AssistantMessage(content="2"),
                                   finish_reason="stop", spec_decode=SPEC)])
    parsed_chat = ChatCompletion.model_validate(chat.model_dump(mode="json"))
    assert parsed_chat.choices[0].message.content == "2"
    assert parsed_chat.model_extra["acceptance"]["num_sequences"] == 1


def test_chunks_read_as_openai_chunks() -> None:
    # OpenAI types a streamed completion as a Completion, whose finish_reason is never
    # null when validated (its client constructs chunks without validating): the last
    # chunk of a choice validates.
    text = openai.CompletionChunk(id="cmpl-1", created=1, model="m", choices=[
        openai.CompletionStreamChoice(index=1, text=" 2", finish_reason="stop")])
    assert Completion.model_validate(text.model_dump(mode="json")).choices[0].text == " 2"
    last = openai.ChatCompletionChunk(id="c", created=1, model="m", choices=[
        openai.ChatStreamChoice(index=0, delta=openai.ChatDelta(content="!"),
                                finish_reason="length", spec_decode=SPEC)])
    parsed = ChatCompletionChunk.model_validate(last.model_dump(mode="json"))
    assert parsed.choices[0].finish_reason == "length"
    assert parsed.choices[0].model_extra["spec_decode"]["accepted_per_position"] == [2, 0]
    usage = openai.ChatCompletionChunk(id="c", created=1, model="m", choices=[], usage=USAGE,
                                       acceptance=ACCEPTANCE)
    parsed_usage = ChatCompletionChunk.model_validate(usage.model_dump(mode="json"))
    assert parsed_usage.usage.completion_tokens == 4 and parsed_usage.choices == []


def test_model_list_is_openais() -> None:
    listing = openai.ModelList(data=[openai.ModelCard(id="m", created=1, owned_by="x")])
    assert listing.model_dump() == {"object": "list", "data": [
        {"id": "m", "object": "model", "created": 1, "owned_by": "x"}]}
