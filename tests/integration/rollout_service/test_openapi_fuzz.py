"""The OpenAPI document tells the truth: schemathesis, every check, against the live service.

Runs against the session's service (real vLLM CPU engine, MTP on, API key and weights
token). Schemathesis reads the service's OpenAPI document and sends what it derives from
it, valid and invalid, to the generation endpoints and the weight endpoints (the native
``/weights/*`` and both dialects' weight-sync routes, with the weights token), and runs
every check it has on each answer: no 5xx, statuses, content types and bodies as
documented, invalid requests refused, valid ones accepted, auth enforced. The session's
service takes ``shm`` pushes, so the dialects' syncs (``nccl`` only) are refused at
their first call: what is fuzzed there is every body's validation and every refusal's
shape, never a rendezvous with a trainer the fuzzer made up.
The document is built at collection time by the same ``create_app`` with the session's
tokens (schemathesis's fixture-loaded schemas do not run under pytest 9), and a test
checks that it is the one the live service serves.
Deterministic: a fixed seed and derandomized Hypothesis, a bounded number of examples;
generation is kept cheap (at most 4 tokens and 2 choices a request, a few prompts a
call) without changing whether a request is valid.

The failures it may find that are intentional, with their reasons, are
:data:`INTENTIONAL`; anything else fails. The weights must come out unchanged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from pydantic import BaseModel, ValidationError
from schemathesis.checks import CHECKS, load_all_checks
from schemathesis.config import SchemathesisConfig
from schemathesis.core.failures import Failure, FailureGroup

from rollout_service.api.app import create_app
from rollout_service.api.dialects.sglang import protocol as sglang
from rollout_service.api.dialects.vllm import protocol as vllm
from rollout_service.config import ServiceConfig
from rollout_service.protocol import messages, openai
from rollout_service.tools.launch import ServiceProcess
from tests.integration.conftest import API_KEY, WEIGHTS_TOKEN, weights_checksums, weights_status

SEED = 20260512
MAX_EXAMPLES = 12
"""Fuzzed examples per operation (the coverage phase adds its own, deterministic ones)."""
DIALECT_WEIGHT_PATHS = ("/init_weights_update_group", "/update_weights_from_distributed",
                        "/destroy_weights_update_group", "/init_weight_transfer_engine",
                        "/shutdown_weight_transfer_engine", "/start_weight_update",
                        "/start_draft_weight_update", "/update_weights",
                        "/finish_weight_update")
"""SGLang's and vLLM's weight-sync routes (docs/dialects.md): the weights token's."""
FUZZED_PATHS = (r"^(/(generate|generate_batch|inference/v1/generate|v1/.*|weights/.*)|"
                + "|".join(DIALECT_WEIGHT_PATHS) + ")$")
"""Generation in every dialect, and the weights in every dialect; not the pause and abort
routes (a fuzzed pause would hold the session's service paused)."""
MAX_TOKENS = 4
MAX_CHOICES = 2
MAX_PROMPTS = 2


SGLANG_ANSWER = "sglang_answer"
"""The ``error_type`` of SGLang's weight routes' refusals, ``{success: false, message}``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Intentional:
    """A failure schemathesis reports that is the service's documented behaviour."""

    check: str
    path: str
    """A regex over the operation's path."""
    status: int
    error_type: str
    """A regex over the answer's ``error.type`` (:data:`SGLANG_ANSWER` for SGLang's
    ``{success: false, message}``)."""
    message: str
    """A regex the answer's ``error.message`` must match."""
    reason: str


INTENTIONAL = (
    Intentional(
        check="positive_data_acceptance",
        path=r"^/(generate|generate_batch|inference/v1/generate|v1/.*)$",
        status=400, error_type="invalid_request_error",
        message=r"is outside the vocabulary|exceed the model's context length|"
                r"contain out-of-vocab token ids",
        reason="The vocabulary size and the context length belong to the served model, and "
               "a text prompt's length in tokens to its tokenizer: JSON Schema cannot state "
               "them, so a token id past the vocabulary (a prompt's or a stop token's), or a "
               "prompt plus max_tokens past the context, is a schema-valid request the engine "
               "refuses (400 naming why)."),
    Intentional(
        check="positive_data_acceptance", path=r"^/(generate|inference/v1/generate|v1/.*)$",
        status=400, error_type="invalid_request_error",
        message=r"min_p and logit_bias sampling parameters are not yet supported with "
                r"speculative decoding|min_tokens must be less than or equal to max_tokens|"
                r"values for \d+ prompts",
        reason="vLLM 0.32 refuses min_p > 0 on an engine with a drafter, and min_tokens "
               "above max_tokens; an SGLang batch needs one value per prompt in each list "
               "field: the engine's state and relations between fields, which JSON Schema "
               "cannot state (the service passes vLLM's refusal on, naming the field)."),
    Intentional(
        check="positive_data_acceptance", path=r"^/weights/(begin|update|finish|abort)$",
        status=400, error_type="weight_push_error", message=r".",
        reason="A push is checked against the served checkpoint (every tensor's name, shape "
               "and dtype, the total bytes), the service's weights transport, the trainer's "
               "shared-memory segment and the active push's announcement: state, not schema "
               "(docs/weight-pushes.md)."),
    Intentional(
        check="positive_data_acceptance", path=r"^/weights/(begin|update)$",
        status=400, error_type="invalid_request_error",
        message=r"is not the contiguous stride|storage_size_bytes: \d+ cannot hold|"
                r"the handle describes|lies in a byte buffer only|is not a multiple of|"
                r"end past the buffer's",
        reason="A CUDA IPC handle, a placement's or begin's staging buffer, must agree "
               "with itself and with its placement (strides "
               "contiguous for its shape, storage large enough, the placement's shape and "
               "dtype, or for a byte buffer the offset's alignment and bounds): relations "
               "between fields, which JSON Schema cannot state."),
    Intentional(
        check="positive_data_acceptance", path=r"^/update_weights(_from_distributed)?$",
        status=400, error_type=SGLANG_ANSWER + "|weight_push_error",
        message=r"dtype(_name)?s, shapes: \d+ dtypes and \d+ shapes for \d+ names",
        reason="A framework's update names its tensors in three lists, one dtype and one "
               "shape per name (SGLang's and vLLM's own messages): a relation between the "
               "lists' lengths, which JSON Schema cannot state (400 naming both fields)."),
    Intentional(
        check="positive_data_acceptance", path=r"^/update_weights_from_distributed$",
        status=400, error_type=SGLANG_ANSWER,
        message=r"transport: 'nccl' is not this service's weights transport 'shm'",
        reason="The session's service takes shm pushes (weights_transport, its "
               "configuration): the frameworks' syncs, which need the trainer's group "
               "(nccl), are refused at their first call, in SGLang's answer."),
)


REQUESTS: dict[str, tuple[type[BaseModel], ...]] = {
    "/generate": (messages.GenerateRequest, sglang.GenerateReqInput),
    "/generate_batch": (messages.BatchGenerateRequest,),
    "/inference/v1/generate": (vllm.TokensRequest,),
    "/v1/completions": (openai.CompletionRequest,),
    "/v1/chat/completions": (openai.ChatCompletionRequest,)}
"""The request models of each fuzzed generation path (``/generate``: both dialects)."""


def bound(path: str, body: Any) -> None:
    """Keep generation cheap: a request the service accepts gets fewer tokens, choices and
    prompts and stays valid; any other is left as it is (it generates nothing)."""
    for model in REQUESTS.get(path, ()):
        try:
            model.model_validate(body)
        except ValidationError:
            continue
        _shrink(body)
        model.model_validate(body)
        return


def _shrink(body: dict[str, Any]) -> None:
    for field, most in (("max_tokens", MAX_TOKENS), ("max_completion_tokens", MAX_TOKENS),
                        ("n", MAX_CHOICES)):
        value = body.get(field)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > most:
            body[field] = most  # validated: an integer, or a float holding one
    if "messages" in body and body.get("max_tokens") is None \
            and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS  # else: up to the context
    prompt = body.get("prompt")
    if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):
        del prompt[MAX_PROMPTS:]
    requests = body.get("requests", [])
    del requests[MAX_PROMPTS:]
    for request in requests:
        _shrink(request)
    _shrink_dialects(body)


SGLANG_BATCH_FIELDS = ("text", "input_ids", "sampling_params", "rid", "return_logprob",
                       "logprob_start_len", "top_logprobs_num")


def _shrink_dialects(body: dict[str, Any]) -> None:
    """SGLang's and vLLM's token-in/token-out bodies: their sampling params nested, an
    SGLang batch's list fields cut alike (one value per prompt stays so)."""
    if isinstance(body.get("text"), list) or (
            isinstance(body.get("input_ids"), list) and isinstance(body["input_ids"][0], list)):
        for field in SGLANG_BATCH_FIELDS:
            if isinstance(body.get(field), list):
                del body[field][MAX_PROMPTS:]
    params = body.get("sampling_params")
    if "input_ids" in body or "text" in body:
        if params is None:
            body["sampling_params"] = params = {}
        for one in params if isinstance(params, list) else [params]:
            if not isinstance(one.get("max_new_tokens"), int) or one["max_new_tokens"] > MAX_TOKENS:
                one["max_new_tokens"] = MAX_TOKENS   # None and the default: 128
            if isinstance(one.get("n"), int) and one["n"] > MAX_CHOICES:
                one["n"] = MAX_CHOICES
    elif "token_ids" in body:
        params = body.setdefault("sampling_params", {})
        params["max_tokens"] = min(params.get("max_tokens", MAX_TOKENS), MAX_TOKENS)
        if isinstance(params.get("n"), int) and params["n"] > MAX_CHOICES:
            params["n"] = MAX_CHOICES


def _headers(path: str) -> dict[str, str]:
    is_weights = path.startswith("/weights") or path in DIALECT_WEIGHT_PATHS
    token = WEIGHTS_TOKEN if is_weights else API_KEY
    return {"authorization": f"Bearer {token}"}


def _error(response: Any) -> dict[str, Any]:
    try:
        body = response.json()
        if isinstance(body, dict) and body.get("success") is False:
            return {"type": SGLANG_ANSWER, "message": body.get("message", "")}
        return body["error"]
    except (ValueError, KeyError, TypeError):
        return {}


def is_intentional(failure: Failure, path: str, response: Any) -> bool:
    error = _error(response)
    return any(entry.check in failure.checks and re.search(entry.path, path)
               and response.status_code == entry.status
               and re.fullmatch(entry.error_type, error.get("type") or "")
               and re.search(entry.message, error.get("message", ""))
               for entry in INTENTIONAL)


@pytest.fixture(scope="module")
def checksums_before(service: ServiceProcess) -> dict[str, str]:
    return weights_checksums(service)


DOCUMENT = create_app(ServiceConfig(api_key=API_KEY, weights_token=WEIGHTS_TOKEN)).openapi()
CONFIG = SchemathesisConfig.from_dict({
    "seed": SEED,
    "generation": {"mode": "all", "max-examples": MAX_EXAMPLES, "deterministic": True,
                   "database": "none", "no-shrink": True},
    "request-timeout": 120,
})
schema = schemathesis.openapi.from_dict(DOCUMENT, config=CONFIG).include(path_regex=FUZZED_PATHS)
load_all_checks()
ALL_CHECKS = CHECKS.get_all()


def test_the_live_service_serves_the_fuzzed_document(service: ServiceProcess) -> None:
    assert httpx.get(f"{service.url}/openapi.json", timeout=60).json() == DOCUMENT


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, derandomize=True, database=None, deadline=None,
          suppress_health_check=list(HealthCheck))
def test_the_service_answers_as_its_openapi_document_says(
        case: Any, service: ServiceProcess, checksums_before: dict[str, str]) -> None:
    bound(case.path, case.body)
    headers = _headers(case.path)
    response = case.call(base_url=service.url, headers=headers)
    try:
        case.validate_response(response, checks=ALL_CHECKS, headers=headers,
                               transport_kwargs={"base_url": service.url})
    except FailureGroup as group:
        unexpected = [f for f in group.exceptions
                      if not is_intentional(f, case.path, response)]
        if unexpected:
            raise FailureGroup(unexpected, str(group)) from None


def test_fuzzing_changed_no_weights(service: ServiceProcess,
                                    checksums_before: dict[str, str]) -> None:
    """Runs after the fuzzing (file order): every push it tried was refused."""
    assert weights_checksums(service) == checksums_before
    assert weights_status(service).active_push_id is None
