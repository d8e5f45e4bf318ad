"""vLLM's rollout dialect: token-in/token-out generation and the RL control routes.

Runs in the service process (standalone, or the Ray Serve ingress); routes only. Mirrors
vllm-project/vllm 0.32 ``vllm/entrypoints/scale_out/token_in_token_out/api_router.py``
(``POST /inference/v1/generate``, ``/inference/v1/abort_requests``),
``vllm/entrypoints/rl/online/api_router.py`` (``/pause``, ``/resume``, ``/is_paused``,
``/abort_requests``, ``/get_world_size``, ``/weight_info``),
``vllm/entrypoints/serve/tokenize/api_router.py`` (``/tokenize``, ``/detokenize``) and
``vllm/entrypoints/serve/dev/cache/api_router.py`` (``/reset_prefix_cache``), which vLLM
mounts with ``VLLM_SERVER_DEV_MODE``; and the two routes AReaL's vLLM backend calls on
its own patched vLLM server (inclusionAI/AReaL
``areal/engine/vllm_ext/areal_vllm_server.py``: ``/areal_pause_generation``,
``/areal_continue_generation``). The paths collide with nothing of the native API.
Generation takes the service's ``api_key`` as every generation route does; so do the
control routes, since the frameworks that call them (SkyRL, AReaL) send no other token.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Query, Request

from rollout_service.api.errors import documented
from rollout_service.api.openai import event_stream, event_stream_doc
from rollout_service.api.ports import GenerationControl, WeightPushes
from rollout_service.choices import Sequences, weight_version_label
from rollout_service.protocol.messages import PauseMode

from . import protocol as vllm
from . import serving
from .serving import TokensServing


def vllm_router(guard: Callable[..., Awaitable[None]] | None) -> APIRouter:
    """The routes; ``guard`` checks the API key (None: open)."""
    auth = (401,) if guard is not None else ()
    router = APIRouter(dependencies=[Depends(guard)] if guard else [],
                       responses=documented(*auth), tags=["vLLM dialect"])

    async def tokens(request: Request) -> TokensServing:
        sequences: Sequences = request.app.state.serving.sequences
        return TokensServing(sequences)

    async def control(request: Request) -> GenerationControl:
        return request.app.state.serving.control

    async def weights(request: Request) -> WeightPushes:
        return request.app.state.serving.weights

    @router.post("/inference/v1/generate", response_model=vllm.TokensResponse,
                 responses={200: event_stream_doc(vllm.TokensStreamResponse),
                            **documented(400, 404, 503)})
    async def generate(req: vllm.TokensRequest,
                       svc: TokensServing = Depends(tokens)) -> Any:
        if req.stream:
            return await event_stream(svc.generate_stream(req))
        return await svc.generate(req)

    @router.post("/pause", responses=documented(400, 503))
    async def pause(mode: Annotated[PauseMode, Query()] = "abort",
                    clear_cache: Annotated[bool, Query(description=(
                        "Deprecated in vLLM; ignored (a push resets the prefix cache)."))] = True,
                    svc: GenerationControl = Depends(control)) -> vllm.PauseAnswer:
        await svc.pause(mode)
        return vllm.PauseAnswer()

    @router.post("/resume", responses=documented(503))
    async def resume(svc: GenerationControl = Depends(control)) -> vllm.ResumeAnswer:
        await svc.resume()
        return vllm.ResumeAnswer()

    @router.post("/areal_pause_generation", responses=documented(503))
    async def areal_pause(svc: GenerationControl = Depends(control)) -> vllm.SuccessAnswer:
        """AReaL's vLLM backend's pause (its patched server's route): abort every request
        and hold new ones until ``/areal_continue_generation``."""
        await svc.pause("abort")
        return vllm.SuccessAnswer(success=True,
                                  message="Generation paused and all requests aborted")

    @router.post("/areal_continue_generation", responses=documented(503))
    async def areal_continue(svc: GenerationControl = Depends(control)) -> vllm.SuccessAnswer:
        await svc.resume()
        return vllm.SuccessAnswer(success=True, message="Generation continued")

    @router.get("/is_paused")
    async def is_paused(svc: GenerationControl = Depends(control)) -> vllm.IsPausedAnswer:
        return vllm.IsPausedAnswer(is_paused=await svc.is_paused())

    async def abort(req: Annotated[vllm.AbortRequests | None, Body()] = None,
                    svc: GenerationControl = Depends(control)) -> vllm.AbortAnswer:
        ids = None if req is None or not req.request_ids else req.request_ids
        return vllm.AbortAnswer(aborted=await svc.abort(ids))

    for path in ("/abort_requests", "/inference/v1/abort_requests"):
        router.add_api_route(path, abort, methods=["POST"], responses=documented(400, 503),
                             summary="Abort requests (all without request_ids)",
                             operation_id=f"abort_requests{path.replace('/', '_')}")

    @router.post("/reset_prefix_cache", responses=documented(503))
    async def reset_prefix_cache(svc: GenerationControl = Depends(control)
                                 ) -> vllm.ResetPrefixCacheAnswer:
        return vllm.ResetPrefixCacheAnswer(success=await svc.reset_prefix_cache())

    @router.post("/tokenize", responses=documented(400, 404, 503))
    async def tokenize(req: vllm.TokenizeRequest,
                       svc: Sequences = Depends(_sequences)) -> vllm.TokenizeAnswer:
        return await serving.tokenize(svc, req)

    @router.post("/detokenize", responses=documented(400, 404, 503))
    async def detokenize(req: vllm.DetokenizeRequest,
                         svc: Sequences = Depends(_sequences)) -> vllm.DetokenizeAnswer:
        return await serving.detokenize(svc, req)

    @router.get("/get_world_size")
    async def get_world_size(include_dp: Annotated[bool, Query()] = True,
                             svc: Sequences = Depends(_sequences)) -> vllm.WorldSizeAnswer:
        return vllm.WorldSizeAnswer(world_size=(await svc.engine_info()).world_size)

    @router.get("/weight_info")
    async def weight_info(svc: WeightPushes = Depends(weights)) -> vllm.WeightInfoAnswer:
        return vllm.WeightInfoAnswer(weight_version=weight_version_label(await svc.get_status()))

    return router


async def _sequences(request: Request) -> Sequences:
    return request.app.state.serving.sequences
