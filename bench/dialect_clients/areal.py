"""AReaL 1.0.4's remote inference engine against the service, with each of its backends:
``SGLangBackend`` (SGLang's dialect) and ``VLLMBackend`` (vLLM's OpenAI dialect).

Per backend: the health check; one generation parsed by the backend's own
``parse_generation_response``; the partial rollout of ``RemoteInfEngine.agenerate`` (a
``--long-tokens`` request, the backend's pause request during it, its tokens so far with
stop reason ``abort``, then after the resume request the prompt plus those tokens
resubmitted for the rest: ``--long-tokens`` in all); the teacher's ``compute_logp``
(``build_score_request`` on the prompt plus 3 target tokens), read by the backend's own
``parse_score_response`` shape: the target tokens' own logprobs (SGLang:
``meta_info.input_token_logprobs[i][0]``, the last 3; vLLM: ``choices[0].prompt_logprobs``,
the last 3 positions, each map's first value, which must be the prompt token's own).

``real`` builds the requests and parses the answers with AReaL's backend classes and its
``ModelRequest`` / ``GenerationHyperparameters``; ``data`` with the same payloads and
parsers written out below.

Upstream (areal 1.0.4): ``areal/engine/sglang_remote.py`` and ``areal/engine/vllm_remote.py``
(``build_generation_request``, ``parse_generation_response``, ``build_score_request``,
``parse_score_response``, ``get_pause_request``, ``get_resume_request``,
``get_health_check_request``), ``areal/infra/remote_inf_engine.py``
(``RemoteInfEngine.agenerate``, ``pause_generation``, ``continue_generation``),
``areal/infra/utils/http.py`` (``arequest_with_retry``), ``areal/api/cli_args.py``
(``GenerationHyperparameters``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import httpx

from .common import (
    PROMPT_IDS,
    SHORT_TOKENS,
    CallFailed,
    Row,
    Target,
    check_partial,
    expect,
    load_real,
)

AREAL = "AReaL 1.0.4"
SOURCES = {
    "sglang": [
        "areal 1.0.4 areal/engine/sglang_remote.py (SGLangBackend.build_generation_request, "
        "parse_generation_response, build_score_request, parse_score_response, "
        "get_pause_request, get_resume_request, get_health_check_request)",
        "areal 1.0.4 areal/infra/remote_inf_engine.py (RemoteInfEngine.agenerate: the "
        "partial-rollout resubmit; pause_generation / continue_generation)",
        "areal 1.0.4 areal/api/cli_args.py (GenerationHyperparameters defaults)"],
    "vllm": [
        "areal 1.0.4 areal/engine/vllm_remote.py (VLLMBackend.build_generation_request, "
        "parse_generation_response, build_score_request, parse_score_response, "
        "get_pause_request, get_resume_request, get_health_check_request)",
        "areal 1.0.4 areal/infra/remote_inf_engine.py (RemoteInfEngine.agenerate)"],
}
TOP_K_ALL = int(1e8)
"""cli_args.py::GenerationHyperparameters.top_k's default."""
TARGET_IDS = [11, 12, 13]
"""The scored tokens of ``compute_logp``, after the prompt."""


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
            # SGLangBackend.build_generation_request, defaults of GenerationHyperparameters;
            # ModelRequest.image_data defaults to []
            return HttpCall("/generate", {
                "input_ids": list(input_ids), "image_data": [],
                "sampling_params": {
                    "top_p": 1.0, "top_k": TOP_K_ALL, "max_new_tokens": max_new_tokens,
                    "temperature": 1.0, "stop_token_ids": [], "ignore_eos": ignore_eos,
                    "skip_special_tokens": True, "frequency_penalty": 0.0},
                "return_logprob": True, "stream": False})
        # VLLMBackend.build_generation_request: a flat body, no model
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
        """``parse_score_response``: the last ``target_len`` prompt positions' logprobs (it
        raises ValueError on a short or missing list)."""
        if self.real:
            return list(self._impl.parse_score_response(answer, target_len))
        if self.backend == "sglang":
            meta = answer.get("meta_info")
            if meta is None:
                raise ValueError("SGLang response missing meta_info for score request")
            logps = [float(x[0]) for x in meta.get("input_token_logprobs", [])]
            if len(logps) < target_len:
                raise ValueError(f"SGLang returned insufficient input_token_logprobs: "
                                 f"{len(logps)} < {target_len}")
            return logps[-target_len:]
        choices = answer.get("choices")
        if not choices:
            raise ValueError("vLLM response missing choices for score request")
        positions = choices[0].get("prompt_logprobs")
        if positions is None:
            raise ValueError("vLLM response missing prompt_logprobs for score request")
        if len(positions) < target_len + 1:
            raise ValueError(f"prompt_logprobs too short: got {len(positions)}, "
                             f"need {target_len + 1}")
        values = [next(iter(p.values())) if p else None for p in positions[-target_len:]]
        return [0.0 if v is None else float(v["logprob"] if isinstance(v, dict) else v)
                for v in values]

    def scored_ids(self, answer: dict[str, Any], target_len: int) -> list[int | None]:
        """The token each value ``parse_score_response`` read belongs to (SGLang: an entry's
        id; vLLM: a map's first key)."""
        if self.backend == "sglang":
            return [e[1] for e in answer["meta_info"]["input_token_logprobs"][-target_len:]]
        return [int(next(iter(p))) if p else None
                for p in answer["choices"][0]["prompt_logprobs"][-target_len:]]


async def run(t: Target, mode: str, backend: str) -> list[Row]:
    row = Row(f"{AREAL} {'SGLangBackend' if backend == 'sglang' else 'VLLMBackend'}",
              "SGLang" if backend == "sglang" else "vLLM OpenAI")

    def load() -> bool:
        import areal.engine.sglang_remote  # noqa: F401
        import areal.engine.vllm_remote  # noqa: F401
        return True

    real = load_real(mode, [row], load) is not None
    if not real and mode == "real":
        return [row]
    row.code = "real" if real else "data"
    shapes = AReaLShapes(backend, real)

    async def send(call: HttpCall, label: str | None = None) -> httpx.Response:
        # http.py::arequest_with_retry posts the payload as JSON; the one GET,
        # RemoteInfEngine.check_health, sends it too (requests' json={})
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
        """agenerate across pause_generation / continue_generation: an aborted answer's
        tokens are kept and the prompt plus them resubmitted."""
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
        call = shapes.score(PROMPT_IDS + TARGET_IDS, len(TARGET_IDS))
        label = f"POST {call.endpoint} (compute_logp)"
        answer = (await send(call, label)).json()
        try:
            logps = shapes.parse_score(answer, len(TARGET_IDS))
        except (ValueError, KeyError, TypeError) as exc:
            raise CallFailed(label, f"parse_score_response: {type(exc).__name__} {exc}") from exc
        expect(len(logps) == len(TARGET_IDS) and all(v < 0 for v in logps), label,
               f"logprobs {logps}")
        ids = shapes.scored_ids(answer, len(TARGET_IDS))
        expect(ids == TARGET_IDS, label, f"the values read are of tokens {ids}, wanted the "
               f"target tokens {TARGET_IDS}")

    await row.step("health", health)
    await row.step("generate", generate)
    await row.step("partial rollout", partial_rollout)
    await row.step("compute_logp", score)
    return [row]
