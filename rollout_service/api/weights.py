"""The ``/weights/*`` router: the push protocol, behind the weights token.

Runs in the service process. Each handler parses a typed message and calls the
app's :class:`~rollout_service.api.ports.WeightPushes`; without a configured
token every endpoint answers 403 (pushes disabled), with one a wrong or missing
bearer token answers 401.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from rollout_service.api.errors import Forbidden, bearer_guard, documented
from rollout_service.api.ports import Rollouts, WeightChecksums, WeightPushes
from rollout_service.protocol import messages


def weights_router(weights_token: str | None) -> APIRouter:
    """The router; ``weights_token`` None disables pushes."""

    async def disabled() -> None:
        raise Forbidden("weight pushes are disabled: no weights token is configured "
                        "(weights_token, weights_token_file or $ROLLOUT_WEIGHTS_TOKEN)")

    guard = bearer_guard(weights_token, scheme_name="weightsToken",
                         description="The service's weights_token (/weights/*).")

    async def pushes(request: Request) -> WeightPushes:
        return request.app.state.serving.weights

    async def rollouts(request: Request) -> Rollouts:
        return request.app.state.serving.rollouts

    router = APIRouter(prefix="/weights", dependencies=[Depends(guard or disabled)],
                       responses=documented(401 if guard else 403))

    @router.post("/group", responses=documented(400, 403, 409))
    async def group(req: messages.WeightGroupRequest,
                    mgr: WeightPushes = Depends(pushes)) -> messages.WeightGroupResponse:
        """Join the trainer's collective group for the 'nccl' transport (the trainer hosts
        its rendezvous and is rank 0; this service's workers take num_ranks ranks from
        rank_offset), then name it in each push's begin (docs/weight-pushes.md)."""
        return await mgr.create_group(req)

    @router.get("/group/state", responses=documented(403))
    async def group_state(mgr: WeightPushes = Depends(pushes)) -> messages.WeightGroupState:
        """How many ranks this service takes in a group, and its current group."""
        return await mgr.group_state()

    @router.post("/group/release", responses=documented(400, 403, 404))
    async def release_group(req: messages.WeightGroupRelease,
                            mgr: WeightPushes = Depends(pushes)) -> messages.WeightGroupState:
        """The owner lets its group go: the workers leave it, and another trainer may make
        one (a push in progress in it is aborted, nothing loaded)."""
        return await mgr.release_group(req)

    @router.post("/begin", responses=documented(400, 409, 503))
    async def begin(req: messages.PushBeginRequest,
                    mgr: WeightPushes = Depends(pushes)) -> messages.PushBeginResponse:
        return await mgr.begin(req)

    @router.post("/update", responses=documented(400, 404, 408, 409))
    async def update(req: messages.PushUpdateRequest,
                     mgr: WeightPushes = Depends(pushes)) -> messages.PushUpdateResponse:
        return await mgr.update(req)

    @router.post("/finish", responses=documented(400, 404, 408, 409, 500, 503))
    async def finish(req: messages.PushFinishRequest,
                     mgr: WeightPushes = Depends(pushes)) -> messages.PushFinishResponse:
        return await mgr.finish(req)

    @router.post("/abort", responses=documented(400, 404, 409))
    async def abort(req: messages.PushAbortRequest,
                    mgr: WeightPushes = Depends(pushes)) -> messages.WeightStatus:
        return await mgr.abort(req)

    @router.get("/status")
    async def status(mgr: WeightPushes = Depends(pushes)) -> messages.WeightStatus:
        return await mgr.get_status()

    @router.get("/checksums")
    async def checksums(svc: Rollouts = Depends(rollouts)) -> WeightChecksums:
        return await svc.weight_checksums()

    return router
