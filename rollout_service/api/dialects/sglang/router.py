"""SGLang's rollout dialect: the control routes, and its side of the shared ``/generate``.

Runs in the service process (standalone, or the Ray Serve ingress); routes only. Mirrors
sgl-project/sglang 0.5.23 ``python/sglang/srt/entrypoints/http_server.py``
(``/pause_generation``, ``/continue_generation``, ``/abort_request``, ``/flush_cache``,
``/health_generate``, ``/server_info``, ``/model_info`` and their ``/get_*`` names,
``/get_weight_version`` of earlier releases) and ``entrypoints/v1_loads.py``
(``/v1/loads``). ``POST /generate`` is the native API's path
too: the app's one handler tells the two apart by the body's keys
(:func:`generate_dialect`) and hands SGLang's to :func:`sglang_generate`. Every route
takes the service's ``api_key`` as generation does (slime and AReaL send no other token).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Request
from fastapi.responses import PlainTextResponse, Response

from rollout_service.api.errors import documented
from rollout_service.api.openai import event_stream
from rollout_service.api.ports import AppState, GenerationControl, WeightPushes
from rollout_service.choices import Sequences, weight_version_label
from rollout_service.weights.checks import PushError

from . import protocol as sgl
from .serving import SGLangServing
from .weights_router import answer
from .weights_serving import SGLangWeights

SGLANG_PROMPT_KEYS = frozenset({"text", "input_ids", "input_embeds", "sampling_params"})
"""Keys only SGLang's ``/generate`` bodies have: the native API's prompt is ``prompt`` or
``prompt_token_ids``, and it refuses any other key, so the two sets never overlap."""

_PAUSE_MODES = {"abort": "abort", "retract": "keep", "in_place": "keep"}
"""SGLang's pause modes -> the service's: both of SGLang's holding modes keep the requests
and finish them on ``/continue_generation`` (retract recomputes their KV; this service's
engine keeps it, and a push resets the prefix cache either way)."""


def generate_dialect(body: Any) -> str:
    """``sglang`` for a body with SGLang's prompt keys, ``native`` for anything else (the
    native model then names what is wrong with it)."""
    if isinstance(body, Mapping) and SGLANG_PROMPT_KEYS & body.keys():
        return "sglang"
    return "native"


async def sglang_generate(req: sgl.GenerateReqInput, state: AppState) -> Any:
    """SGLang's ``/generate``: its answer, or its server-sent events ending ``[DONE]``."""
    serving = SGLangServing(state.sequences)
    if req.stream:
        return await event_stream(serving.generate_stream(req))
    return await serving.generate(req)


def sglang_router(guard: Callable[..., Awaitable[None]] | None) -> APIRouter:
    """The control routes; ``guard`` checks the API key (None: open)."""
    auth = (401,) if guard is not None else ()
    router = APIRouter(dependencies=[Depends(guard)] if guard else [],
                       responses=documented(*auth), tags=["SGLang dialect"])

    async def control(request: Request) -> GenerationControl:
        return request.app.state.serving.control

    async def weights(request: Request) -> WeightPushes:
        return request.app.state.serving.weights

    async def sequences(request: Request) -> Sequences:
        return request.app.state.serving.sequences

    @router.post("/pause_generation", responses=documented(400, 503))
    async def pause_generation(
            req: Annotated[sgl.PauseGenerationReqInput | None, Body()] = None,
            svc: GenerationControl = Depends(control)) -> sgl.StatusAnswer:
        await svc.pause(_PAUSE_MODES[(req or sgl.PauseGenerationReqInput()).mode])
        return sgl.StatusAnswer(message="Generation paused successfully.")

    @router.post("/continue_generation", responses=documented(400, 408, 409, 500, 503))
    async def continue_generation(
            request: Request,
            req: Annotated[sgl.ContinueGenerationReqInput | None, Body()] = None,
            svc: GenerationControl = Depends(control)) -> Any:
        """End the pause; a weight sync of /update_weights_from_distributed calls since
        the pause loads first, whole (its failure is answered, generation resumes on the
        old weights)."""
        serving = request.app.state.serving
        try:
            await SGLangWeights(serving.weights, svc, serving.sequences).commit()
        except PushError as exc:
            await svc.resume()
            return answer(False, f"the weight sync did not load: {exc}", exc.status)
        await svc.resume()
        return sgl.StatusAnswer(message="Generation continued successfully.")

    @router.post("/abort_request", responses=documented(400, 503))
    async def abort_request(req: sgl.AbortReq,
                            svc: GenerationControl = Depends(control)) -> Response:
        if req.abort_all:
            await svc.abort(None)
        elif req.rid:
            await svc.abort([req.rid])
        return Response(status_code=200)

    async def flush_cache(svc: GenerationControl = Depends(control)) -> PlainTextResponse:
        if await svc.reset_prefix_cache():
            return PlainTextResponse("Cache flushed.\n")
        return PlainTextResponse("Cache not flushed: requests are running or waiting.\n",
                                 status_code=400)

    for method in ("GET", "POST"):
        router.add_api_route("/flush_cache", flush_cache, methods=[method],
                             response_class=PlainTextResponse, responses=documented(503),
                             operation_id=f"flush_cache_{method.lower()}")

    @router.get("/health_generate", responses={503: {"description": "Cannot serve."}})
    async def health_generate(request: Request) -> Response:
        """SGLang's deep health check; here the engine's own (as ``/health``)."""
        _, status = await request.app.state.serving.rollouts.health()
        return Response(status_code=status)

    @router.get("/get_weight_version")
    async def get_weight_version(svc: WeightPushes = Depends(weights)
                                 ) -> sgl.WeightVersionAnswer:
        return sgl.WeightVersionAnswer(weight_version=weight_version_label(await svc.get_status()))

    async def server_info(seqs: Sequences = Depends(sequences),
                          svc: WeightPushes = Depends(weights)) -> sgl.ServerInfo:
        info = await seqs.engine_info()
        k = info.num_speculative_tokens
        return sgl.ServerInfo(
            model_path=info.model_path, served_model_name=info.model, tp_size=info.world_size,
            num_gpus=info.world_size, context_length=info.max_model_len,
            speculative_algorithm=info.speculative_method, speculative_num_steps=k or None,
            speculative_eagle_topk=1 if k else None,
            speculative_num_draft_tokens=k + 1 if k else None,
            weight_version=weight_version_label(await svc.get_status()),
            version=f"mtp-rollout ({info.engine})")

    async def model_info(seqs: Sequences = Depends(sequences),
                         svc: WeightPushes = Depends(weights)) -> sgl.ModelInfo:
        info = await seqs.engine_info()
        return sgl.ModelInfo(model_path=info.model_path, served_model_name=info.model,
                             tokenizer_path=info.model_path,
                             weight_version=weight_version_label(await svc.get_status()))

    for path, route in (("/server_info", server_info), ("/get_server_info", server_info),
                        ("/model_info", model_info), ("/get_model_info", model_info)):
        router.add_api_route(path, route, methods=["GET"], operation_id=path.strip("/"))

    @router.get("/v1/loads")
    async def loads(svc: GenerationControl = Depends(control),
                    seqs: Sequences = Depends(sequences)) -> sgl.LoadsAnswer:
        running = await svc.num_running()
        return sgl.LoadsAnswer(
            timestamp=datetime.fromtimestamp(time.time(), UTC).isoformat(),
            version="mtp-rollout", num_accelerators=(await seqs.engine_info()).world_size,
            loads=[sgl.Load(dp_rank=i, num_running_reqs=n) for i, n in enumerate(running)])

    return router
