"""HTTP client of the rollout service (httpx), for trainers, tools and tests.

Runs in the caller's process and speaks only the JSON messages of
``protocol.messages`` (and ``protocol.speculation``). Every error the service answers
becomes one exception type, :class:`ServiceError`, parsed in one place (:func:`raise_for_error`),
whether it came to :class:`RolloutClient` (async: generation, health, weight
status, pinned K schedules) or to the trainer's ``WeightPusher`` (sync: the push protocol).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import Any

import httpx
from pydantic import BaseModel

from rollout_service.protocol import messages
from rollout_service.protocol.speculation import (
    PinScheduleRequest,
    ScheduleEntry,
    SpeculationControlStatus,
)


class ServiceError(RuntimeError):
    """The service answered with an error: ``status`` is the HTTP code, ``message`` the
    service's explanation (it names the field or tensor at fault). A refused push
    changed nothing on the service."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


def raise_for_error(response: httpx.Response) -> None:
    """Raise :class:`ServiceError` for a non-2xx answer (OpenAI's error shape, or the
    raw text when a proxy answered instead of the service)."""
    if response.is_success:
        return
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text
    raise ServiceError(response.status_code, message)


def bearer(token: str | None) -> dict[str, str]:
    """The authorization header for ``token`` (none without one)."""
    return {"authorization": f"Bearer {token}"} if token else {}


def json_body(message: BaseModel) -> dict[str, Any]:
    """A request message as sent on the wire (unset optional fields left out)."""
    return message.model_dump(mode="json", exclude_none=True)


class RolloutClient:
    """Typed async calls to one service URL.

    Args:
        base_url: e.g. ``http://127.0.0.1:8000``.
        api_key: bearer token of the generation endpoints, if the service has one.
        weights_token: bearer token of ``/weights/*`` and ``/speculation/*`` (only
            :meth:`weight_status` and :meth:`pin_schedule` need it).
        timeout_s: per-request timeout; rollouts can be long.
        max_connections: connection pool size. Requests beyond it wait for a free
            connection instead of opening more sockets than the host allows.
    """

    def __init__(self, base_url: str, *, api_key: str | None = None,
                 weights_token: str | None = None, timeout_s: float = 600.0,
                 max_connections: int = 256) -> None:
        limits = httpx.Limits(max_connections=max_connections,
                              max_keepalive_connections=max_connections)
        self._http = httpx.AsyncClient(base_url=base_url, headers=bearer(api_key),
                                       timeout=timeout_s, limits=limits)
        self._weights_headers = bearer(weights_token)

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self._http.aclose()

    async def _post(self, path: str, body: BaseModel) -> Any:
        response = await self._http.post(path, json=json_body(body))
        raise_for_error(response)
        return response.json()

    async def generate(self, req: messages.GenerateRequest) -> messages.GenerateResponse:
        return messages.GenerateResponse.model_validate(await self._post("/generate", req))

    async def generate_batch(self, req: messages.BatchGenerateRequest
                             ) -> messages.BatchGenerateResponse:
        return messages.BatchGenerateResponse.model_validate(
            await self._post("/generate_batch", req))

    async def health(self) -> messages.HealthResponse:
        """``/health``, whatever its status code (503 bodies say what is wrong)."""
        response = await self._http.get("/health")
        return messages.HealthResponse.model_validate(response.json())

    async def weight_status(self) -> messages.WeightStatus:
        response = await self._http.get("/weights/status", headers=self._weights_headers)
        raise_for_error(response)
        return messages.WeightStatus.model_validate(response.json())

    async def pin_schedule(self, schedule: Mapping[int, int] | None
                           ) -> SpeculationControlStatus:
        """``POST /speculation/schedule`` (weights token): run ``schedule`` (batch-size bucket
        upper edge -> K) whatever the speculation controller decides; None hands K back to
        the controller. Returns the controller's state once the engine runs it."""
        entries = None if schedule is None else [ScheduleEntry(batch_size=b, k=k)
                                                 for b, k in schedule.items()]
        response = await self._http.post(
            "/speculation/schedule", headers=self._weights_headers,
            json=PinScheduleRequest(schedule=entries).model_dump(mode="json"))
        raise_for_error(response)
        return SpeculationControlStatus.model_validate(response.json())

    async def metrics_text(self) -> str:
        response = await self._http.get("/metrics")
        raise_for_error(response)
        return response.text
