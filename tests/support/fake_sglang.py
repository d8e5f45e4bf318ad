"""A FAKE SGLang HTTP server: SGLang's wire format over a toy model, no inference.

SGLang cannot serve here (it needs CUDA kernels), so the SGLang engine's tests run
against this FastAPI app inside the test process, through httpx's ASGI transport.
Request bodies are parsed by pydantic models named like SGLang's request classes, with
their field names per version (``PROFILES``, from ``fake_sglang_profiles``, which says
how they are checked against SGLang's own sources). Responses mirror the dicts SGLang's
tokenizer manager builds (``meta_info`` keys, finish reasons, logprob triples).

The toy model (what it generates, the speculative counts) is ``fake_sglang_model``'s.
Every call is recorded in ``calls``; tensor payloads are recorded, never unpickled.

``"stream": true`` on ``/generate`` answers as SGLang does (``engines/sglang/answers.py``):
server-sent events, one per decode step (the prefill's token, then each verify step's
accepted tokens plus one), each shaped as a non-streamed answer with ``finish_reason``
null until the last, then ``data: [DONE]``; a refusal is an error event under status 200.
Text, ids and logprobs are cumulative, or each step's delta with
``incremental_streaming_output`` (reported in ``/server_info``, as SGLang's server
arguments are). A client that goes away mid-stream aborts the request (``aborted``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel

from rollout_service.protocol.sse import DONE_EVENT, encode_event
from tests.support.fake_sglang_model import ToyModel
from tests.support.fake_sglang_profiles import PROFILES, request_models


@dataclass
class _Running:
    abort: asyncio.Event = field(default_factory=asyncio.Event)


class FakeSGLang:
    """One fake server; ``app`` is its FastAPI application.

    Args:
        profile: the SGLang version to speak (a key of ``PROFILES``).
        model_path: reported as the served checkpoint.
        speculative: ``speculative_*`` server args (None: speculation off).
        tp_size: reported TP size.
        is_openapi_enabled: False mimics ``DISABLE_OPENAPI_DOC``.
        incremental_streaming_output: streams send each step's delta (SGLang's server
            argument of that name).
    """

    def __init__(self, profile: str, *, model_path: str, context_length: int = 256,
                 speculative: dict[str, Any] | None = None, tp_size: int = 1,
                 is_openapi_enabled: bool = True,
                 incremental_streaming_output: bool = False) -> None:
        self.profile = PROFILES[profile]
        self.model_path = model_path
        self.context_length = context_length
        self.speculative = speculative
        self.tp_size = tp_size
        self.base_gpu_id = 0  # SGLang's --base-gpu-id, reported in /server_info
        self.model = ToyModel()
        """What it generates and the speculative counts it reports (tests change its fields)."""
        self.generate_delay_s = 0.0
        self.stream_step_s = 0.0
        """Pause between the events of a stream."""
        self.hold_until_running = 0
        """Hold every /generate until this many run at once (0: never hold), which a client
        that caps its connections below it never reaches."""
        self.max_running = 0
        """The most /generate requests that ran at once."""
        self._enough_running = asyncio.Event()
        self.incremental_streaming_output = incremental_streaming_output
        self.num_streaming = 0
        """Streams still sending."""
        self.aborted: list[str] = []
        """Request ids of streams whose client went away before the end."""
        self.is_healthy = True
        self.is_reporting_spec = True
        """False: a speculative server whose responses carry no spec_* keys."""
        self.responses: list[dict[str, Any]] = []
        """Every /generate response body, in order."""
        self.weight_version = "default"
        self.calls: list[tuple[str, Any]] = []
        self._is_paused = False
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._running: list[_Running] = []
        self._session: str | None = None
        self._loads = {"target": 0, "draft": 0}
        self.app = self._build_app(is_openapi_enabled)

    def routes_called(self) -> list[str]:
        """Paths of the recorded calls, in order."""
        return [path for path, _ in self.calls]

    def _build_app(self, is_openapi_enabled: bool) -> FastAPI:
        app = FastAPI(openapi_url="/openapi.json" if is_openapi_enabled else None)
        models = request_models(self.profile)

        @app.middleware("http")
        async def record(request: Request, call_next: Any) -> Any:
            body = await request.body()
            self.calls.append((request.url.path, (await request.json()) if body else None))
            return await call_next(request)

        def post(path: str, model_name: str, handler: Any) -> None:
            model = models[model_name]

            async def endpoint(obj: BaseModel) -> Any:
                return await handler(obj.model_dump())

            endpoint.__annotations__["obj"] = model  # FastAPI reads the body model from here
            app.post(path)(endpoint)

        for route in ("/model_info", "/get_model_info"):
            app.get(route)(self._model_info)
        for route in ("/server_info", "/get_server_info"):
            app.get(route)(self._server_info)
        app.get("/v1/models")(self._models)
        app.get("/health")(self._health)
        for method in ("get", "post"):  # GET and POST, as in SGLang
            app.add_api_route("/flush_cache", self._flush_cache, methods=[method],
                              operation_id=f"flush_cache_{method}")
            app.add_api_route("/weights_checker", self._weights_checker, methods=[method],
                              operation_id=f"weights_checker_{method}")
        app.post("/v1/tokenize")(self._tokenize)
        post("/generate", "GenerateReqInput", self._generate)
        post("/pause_generation", "PauseGenerationReqInput", self._pause)
        post("/continue_generation", "ContinueGenerationReqInput", self._continue)
        post("/update_weights_from_tensor", "UpdateWeightsFromTensorReqInput", self._load)
        if self.profile.has_weight_update_session:
            post("/begin_weight_update", "BeginWeightUpdateReqInput", self._begin)
            post("/end_weight_update", "EndWeightUpdateReqInput", self._end)
        return app

    # --- info ---

    async def _model_info(self) -> dict[str, Any]:
        return {"model_path": self.model_path, "tokenizer_path": self.model_path,
                "is_generation": True, "preferred_sampling_params": None,
                "weight_version": self.weight_version, "has_image_understanding": False,
                "has_audio_understanding": False, "model_type": "mimo",
                "architectures": ["MiMoForCausalLM"]}

    async def _server_info(self) -> dict[str, Any]:
        spec = self.speculative or {}
        return {"model_path": self.model_path, "served_model_name": self.model_path,
                "context_length": None, "tp_size": self.tp_size, "dp_size": 1,
                "base_gpu_id": self.base_gpu_id, "weight_version": "default",
                "speculative_algorithm": spec.get("speculative_algorithm"),
                "speculative_num_steps": spec.get("speculative_num_steps"),
                "speculative_eagle_topk": spec.get("speculative_eagle_topk"),
                "speculative_num_draft_tokens": spec.get("speculative_num_draft_tokens"),
                "max_total_num_tokens": 4096, "internal_states": [],
                "max_req_input_len": self.context_length - 6, "version": self.profile.version,
                "incremental_streaming_output": self.incremental_streaming_output}

    async def _models(self) -> dict[str, Any]:
        card = {"id": self.model_path, "object": "model", "created": 0, "owned_by": "sglang",
                "root": self.model_path, "parent": None, "max_model_len": self.context_length}
        return {"object": "list", "data": [card]}

    async def _health(self) -> Any:
        return PlainTextResponse("", status_code=200 if self.is_healthy else 503)

    async def _tokenize(self, request: Request) -> dict[str, Any]:
        tokens = self.model.encode((await request.json())["prompt"])
        return {"tokens": tokens, "count": len(tokens), "max_model_len": self.context_length}

    # --- generation ---

    async def _generate(self, obj: dict[str, Any]) -> Any:
        if obj["input_ids"] is None and obj["text"] is None:
            return JSONResponse({"error": {"message": "Either text or input_ids should be "
                                                      "provided."}}, status_code=400)
        await self._resumed.wait()  # SGLang holds new requests while paused
        prompt_ids = (obj["input_ids"] if obj["input_ids"] is not None
                      else self.model.encode(obj["text"]))
        if len(prompt_ids) >= self.context_length:
            error = {"error": {"message": f"The input ({len(prompt_ids)} tokens) is longer than "
                                         "the model's context length"}}
            if obj["stream"]:  # SGLang raises inside the stream: an error event, status 200
                events = [encode_event(json.dumps(error)), DONE_EVENT]
                return StreamingResponse(iter(events), media_type="text/event-stream")
            return JSONResponse(error, status_code=400)
        running = _Running()
        self._running.append(running)
        self.max_running = max(self.max_running, len(self._running))
        if len(self._running) >= self.hold_until_running:
            self._enough_running.set()
        try:
            await self._enough_running.wait()
            if self.generate_delay_s:
                try:
                    await asyncio.wait_for(running.abort.wait(), self.generate_delay_s)
                except TimeoutError:
                    pass
            while self._is_paused and not running.abort.is_set():
                await self._resumed.wait()  # retracted or frozen: finishes after continue
        finally:
            self._running.remove(running)
        params = obj["sampling_params"] or {}
        if running.abort.is_set():
            output_ids: list[int] = []
            text = ""
            finish = {"type": "abort", "message": "Abort in waiting queue", "status_code": None,
                      "err_type": None}
        else:
            output_ids, text, finish = self.model.complete(prompt_ids, params)
        meta = self._meta_info(obj, prompt_ids, output_ids, finish)
        out = {"text": text, "output_ids": output_ids, "meta_info": meta}
        if obj.get("return_prompt_token_ids"):
            out["prompt_token_ids"] = prompt_ids
        self.responses.append(out)
        if obj["stream"]:
            return StreamingResponse(self._stream(obj["rid"], out),
                                     media_type="text/event-stream")
        return out

    async def _stream(self, rid: str, out: dict[str, Any]) -> Any:
        """``out`` as SGLang streams it (module docstring)."""
        ids, meta = out["output_ids"], out["meta_info"]
        logprobs = meta.get("output_token_logprobs")
        is_delta = self.incremental_streaming_output
        ends = self.model.steps(len(ids))
        self.num_streaming += 1
        sent = 0
        try:
            for end in ends:
                is_last = end == ends[-1]
                text = out["text"] if is_last else self.model.decode(ids[:end])
                start = sent if is_delta else 0
                step_meta = dict(meta) if is_last else {
                    "id": rid, "finish_reason": None, "prompt_tokens": meta["prompt_tokens"],
                    "weight_version": self.weight_version, "completion_tokens": end,
                    "cached_tokens": 0}
                if logprobs is not None:
                    step_meta["output_token_logprobs"] = logprobs[start:end]
                event = {"text": text[len(self.model.decode(ids[:sent])):] if is_delta else text,
                         "output_ids": ids[start:end], "meta_info": step_meta}
                yield encode_event(json.dumps(event))
                sent = end
                if self.stream_step_s and not is_last:
                    await asyncio.sleep(self.stream_step_s)
            yield DONE_EVENT
        except asyncio.CancelledError:
            self.aborted.append(rid)  # the client went away: SGLang aborts the request
            raise
        finally:
            self.num_streaming -= 1

    def _meta_info(self, obj: dict[str, Any], prompt_ids: list[int], output_ids: list[int],
                   finish: dict[str, Any]) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": obj["rid"], "finish_reason": finish, "prompt_tokens": len(prompt_ids),
            "weight_version": self.weight_version, "total_retractions": 0,
            "reasoning_tokens": 0, "completion_tokens": len(output_ids), "cached_tokens": 0}
        if obj["return_logprob"]:
            meta["output_token_logprobs"] = [[-0.25 * (i + 1), t, None]
                                             for i, t in enumerate(output_ids)]
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs_length"] = len(output_ids)
        if self.speculative and self.is_reporting_spec:
            meta.update(self.model.spec_meta_info(
                len(output_ids), num_steps=self.speculative["speculative_num_steps"],
                num_draft_tokens=self.speculative["speculative_num_draft_tokens"],
                profile=self.profile))
        if self.profile.has_weight_version_spans:
            meta["weight_versions"] = [{"version": self.weight_version, "start": 0,
                                        "end": len(output_ids)}]
        meta["e2e_latency"] = 0.01
        return meta

    # --- control ---

    async def _pause(self, obj: dict[str, Any]) -> dict[str, Any]:
        self._is_paused = True
        self._resumed.clear()
        if obj["mode"] == "abort":
            for running in self._running:
                running.abort.set()
        return {"message": "Generation paused successfully.", "status": "ok"}

    async def _continue(self, obj: dict[str, Any]) -> dict[str, Any]:
        self._is_paused = False
        self._resumed.set()
        return {"message": "Generation continued successfully.", "status": "ok"}

    async def _flush_cache(self, timeout: float = Query(0.0)) -> Any:
        if self._running and not self._is_paused:
            return PlainTextResponse("Flush cache failed.\n", status_code=400)
        return PlainTextResponse("Cache flushed.\n")

    async def _begin(self, obj: dict[str, Any]) -> Any:
        if self._session is not None:
            return _refuse("a weight update session is already open")
        self._session = obj["selector"]
        return {"success": True, "message": "Weight update session opened."}

    async def _end(self, obj: dict[str, Any]) -> Any:
        if self._session is None:
            return _refuse("no weight update session is open")
        self._session = None
        return {"success": True, "message": "Weight update session closed."}

    async def _load(self, obj: dict[str, Any]) -> Any:
        """Check the session, count loads per model, bump the version."""
        if self.profile.has_weight_update_session:
            if self._session is None:
                return _refuse("call /begin_weight_update first")
            if obj["selector"] != self._session:
                return _refuse(f"selector {obj['selector']!r} outside the open "
                               f"{self._session!r} session")
        if len(obj["serialized_named_tensors"]) != self.tp_size:
            return _refuse(f"expected one payload per TP rank ({self.tp_size})")
        roles = {"target": ("target",), "draft": ("draft",), "all": ("target", "draft")}
        if "selector" in obj:
            selected = roles[obj["selector"]]
        else:  # 0.5.10-0.5.12: the draft path loads the drafter and then the target
            selected = ("target",) if obj.get("disable_draft_model") else ("target", "draft")
        for role in selected:
            self._loads[role] += 1
        if obj["weight_version"] is not None:
            self.weight_version = obj["weight_version"]
        return {"success": True, "message": "Succeeded to update model weights."}

    async def _weights_checker(self, request: Request) -> Any:
        body = await request.json() if await request.body() else {}
        if "selector" not in self.profile.models["CheckWeightsReqInput"]:
            return _refuse(f"Unsupported action: {body.get('action')}")
        role = body.get("selector", "all")
        digest = hashlib.sha256(f"{role}:{self._loads.get(role, 0)}".encode()).hexdigest()
        return {"success": True, "message": "", "per_engine_checksum": digest}


def _refuse(message: str) -> JSONResponse:
    return JSONResponse({"success": False, "message": message}, status_code=400)

