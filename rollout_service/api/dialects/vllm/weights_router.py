"""vLLM's weight-sync routes; routes only.

Runs in the service process (standalone, or the Ray Serve ingress). Mirrors
vllm-project/vllm 0.32 ``vllm/entrypoints/rl/online/api_router.py``
(``/init_weight_transfer_engine``, ``/shutdown_weight_transfer_engine``,
``/start_weight_update``, ``/start_draft_weight_update``, ``/update_weights``,
``/finish_weight_update``), which vLLM mounts with ``VLLM_SERVER_DEV_MODE`` and SkyRL
0.4.0 calls (``skyrl/backends/skyrl_train/weight_sync/control_plane.py``). Each answers
vLLM's ``{"message": ...}``; a failure answers its status with the service's error body
(``{"error": {"message"...}}``, which SkyRL's client reads). Auth: ``weights_auth.py``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import APIRouter, Body, Depends, Request

from rollout_service.api.dialects.weight_stream import WEIGHT_VERSION_PATTERN
from rollout_service.api.errors import documented

from . import weights_protocol as wire
from .weights_serving import VLLMWeights


def vllm_weights_router(guard: Callable[..., Awaitable[None]] | None) -> APIRouter:
    """The routes; ``guard`` checks the weights token (None: open)."""
    auth = (401,) if guard is not None else ()
    router = APIRouter(dependencies=[Depends(guard)] if guard else [],
                       responses=documented(*auth, 400, 403, 409),
                       tags=["vLLM dialect: weight sync"])

    async def weights(request: Request) -> VLLMWeights:
        return VLLMWeights(request.app.state.serving.weights)

    @router.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(
            req: wire.InitWeightTransferEngineRequest,
            svc: VLLMWeights = Depends(weights)) -> wire.WeightsMessage:
        """Join the trainer's group (vLLM's StatelessProcessGroup; the trainer is rank 0);
        one at a time: another trainer's is 409 until shut down or its lease ends."""
        await svc.init(req.init_info)
        return wire.WeightsMessage(message="Weight transfer initialized")

    @router.post("/shutdown_weight_transfer_engine", responses=documented(404))
    async def shutdown_weight_transfer_engine(
            svc: VLLMWeights = Depends(weights)) -> wire.WeightsMessage:
        await svc.shutdown()
        return wire.WeightsMessage(message="Weight transfer shut down")

    @router.post("/start_weight_update")
    async def start_weight_update(svc: VLLMWeights = Depends(weights)
                                  ) -> wire.WeightsMessage:
        """Open the main model's session: every checkpoint tensor, by its name."""
        await svc.start(draft=False)
        return wire.WeightsMessage(message="Weight update started")

    @router.post("/start_draft_weight_update")
    async def start_draft_weight_update(svc: VLLMWeights = Depends(weights)
                                        ) -> wire.WeightsMessage:
        """Open the drafter's session: the MTP layers' tensors (and the embedding and
        head it shares), by the checkpoint's names."""
        await svc.start(draft=True)
        return wire.WeightsMessage(message="Draft weight update started")

    @router.post("/update_weights", responses=documented(408))
    async def update_weights(req: wire.UpdateWeightsRequest,
                             svc: VLLMWeights = Depends(weights)) -> wire.WeightsMessage:
        """Receive these tensors as the trainer broadcasts them (checked against the served
        checkpoint first); they load at /finish_weight_update."""
        infos = req.update_info if isinstance(req.update_info, list) else [req.update_info]
        await svc.update(infos)
        return wire.WeightsMessage(message="Weights updated")

    @router.post("/finish_weight_update", responses=documented(408, 500, 503))
    async def finish_weight_update(
            weight_version: Annotated[str | None, Body(
                embed=True, pattern=WEIGHT_VERSION_PATTERN, description=(
                    "The version the session makes: a decimal integer newer than the "
                    "served one; null: the next one (a drafter session: the main "
                    "model's)."))] = None,
            svc: VLLMWeights = Depends(weights)) -> wire.WeightsMessage:
        """Load the session whole (or nothing), and serve its version."""
        await svc.finish(weight_version)
        return wire.WeightsMessage(message="Weight update finished")

    return router
