"""SGLang's weight-sync routes; routes only.

Runs in the service process (standalone, or the Ray Serve ingress). Mirrors
sgl-project/sglang 0.5.23 ``python/sglang/srt/entrypoints/http_server.py``
(``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group``): each answers ``{success, message}``, 200 when it
succeeded and otherwise the failure's own status (SGLang answers 400 for every failure;
a second trainer's group is 409 here, a broadcast that broke 408). The commit of a sync,
at ``/continue_generation``, is in ``router.py``. Auth: ``weights_auth.py``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Union

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from rollout_service.api.errors import ERROR_DESCRIPTIONS, documented
from rollout_service.protocol.messages import ErrorResponse
from rollout_service.weights.checks import PushError

from . import weights_protocol as sgl
from .weights_serving import SGLangWeights

_ERRORS = {status: {
    "model": Union[sgl.WeightsAnswer, ErrorResponse],  # documented as anyOf of the two
    "description": ERROR_DESCRIPTIONS[status] + (
        " A refusal of the sync answers SGLang's {success: false, message} (slime and AReaL "
        "read it); a malformed body or a token refused, the service's error body.")}
    for status in (400, 403, 404, 408, 409, 500, 503)}


def answer(success: bool, message: str, status: int = 200) -> JSONResponse:
    """SGLang's ``{success, message}`` with ``status``."""
    return JSONResponse(sgl.WeightsAnswer(success=success, message=message).model_dump(),
                        status_code=status)


async def answered(work: Awaitable[Any], message: str) -> JSONResponse:
    """SGLang's answer to ``work``: its message, or the refusal's status and reason."""
    try:
        await work
    except PushError as exc:
        return answer(False, str(exc), exc.status)
    return answer(True, message)


def sglang_weights_router(guard: Callable[..., Awaitable[None]] | None) -> APIRouter:
    """The routes; ``guard`` checks the weights token (None: open)."""
    auth = (401,) if guard is not None else ()
    router = APIRouter(dependencies=[Depends(guard)] if guard else [],
                       responses={**documented(*auth), **_ERRORS},
                       tags=["SGLang dialect: weight sync"])

    async def weights(request: Request) -> SGLangWeights:
        serving = request.app.state.serving
        return SGLangWeights(serving.weights, serving.control, serving.sequences)

    @router.post("/init_weights_update_group", response_model=sgl.WeightsAnswer)
    async def init_weights_update_group(req: sgl.InitWeightsUpdateGroupReqInput,
                                        svc: SGLangWeights = Depends(weights)) -> JSONResponse:
        """Join the trainer's group (it is rank 0 and hosts the store); one group at a
        time (a second trainer's is 409 until the first is destroyed or its lease ends)."""
        return await answered(svc.init_group(req),
                              "Succeeded to initialize custom process group.")

    @router.post("/update_weights_from_distributed", response_model=sgl.WeightsAnswer)
    async def update_weights_from_distributed(
            req: sgl.UpdateWeightsFromDistributedReqInput,
            svc: SGLangWeights = Depends(weights)) -> JSONResponse:
        """Receive these tensors as the trainer broadcasts them (checked against the
        served checkpoint first); they load, with the rest of the sync, at
        /continue_generation."""
        return await answered(svc.update(req), "Succeeded to update parameter online.")

    @router.post("/destroy_weights_update_group", response_model=sgl.WeightsAnswer)
    async def destroy_weights_update_group(
            req: sgl.DestroyWeightsUpdateGroupReqInput,
            svc: SGLangWeights = Depends(weights)) -> JSONResponse:
        """Leave the group (a sync in progress in it is aborted: nothing loads)."""
        return await answered(svc.destroy_group(req),
                              "Succeeded to destroy custom process group.")

    return router
