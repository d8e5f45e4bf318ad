"""The ``/speculation/*`` router: pin a K schedule over the speculation controller.

Runs in the service process. Behind the weights token, as a control-plane call of the
trainer or the operator (a benchmark pins each static K on one running engine). Without a
speculation control (``speculation_control.enabled``, or under Ray Serve) it answers 403.
The controller's state itself is in ``/health``.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from rollout_service.api.errors import Forbidden, bearer_guard, documented
from rollout_service.api.ports import SchedulePins
from rollout_service.protocol.speculation import PinScheduleRequest, SpeculationControlStatus
from rollout_service.service import SpeculationControlOff


def speculation_router(weights_token: str | None) -> APIRouter:
    """The router; ``weights_token`` None disables it, as it disables weight pushes."""

    async def disabled() -> None:
        raise Forbidden("the speculation endpoints are disabled: no weights token is "
                        "configured (weights_token, weights_token_file or "
                        "$ROLLOUT_WEIGHTS_TOKEN)")

    guard = bearer_guard(weights_token, scheme_name="weightsToken",
                         description="The service's weights_token (/weights/*).")

    async def pins(request: Request) -> SchedulePins:
        speculation = request.app.state.serving.speculation
        if speculation is None:
            raise SpeculationControlOff("this service runs no speculation control "
                                        "(speculation_control.enabled; standalone only)")
        return speculation

    router = APIRouter(prefix="/speculation", dependencies=[Depends(guard or disabled)],
                       responses=documented(401 if guard else 403))

    @router.post("/schedule", responses=documented(400, 403, 503))
    async def pin(req: PinScheduleRequest,
                  svc: SchedulePins = Depends(pins)) -> SpeculationControlStatus:
        """Run this K schedule whatever the controller decides (``schedule: null`` hands
        K back to the controller); answers the controller's state once the engine runs it.
        A K above the engine's ``num_speculative_tokens`` is refused (400) and the schedule
        in force stays."""
        return await svc.pin_schedule(req.table())

    return router
