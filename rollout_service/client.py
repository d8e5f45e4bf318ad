"""Async HTTP client of the rollout service (httpx), for trainers, the demo and tests.

Runs in the caller's process; speaks only the JSON messages of ``wire``.
"""

from __future__ import annotations

from types import TracebackType

import httpx

from rollout_service import wire


class ServiceError(RuntimeError):
    """The service answered with an error; ``status`` and ``message`` say which."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class RolloutClient:
    """Typed calls to one service URL.

    Args:
        base_url: e.g. ``http://127.0.0.1:8000``.
        api_key: bearer token for generation endpoints, if the service has one.
        timeout_s: per-request timeout; rollouts can be long.
    """

    def __init__(self, base_url: str, *, api_key: str | None = None,
                 timeout_s: float = 600.0) -> None:
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout_s)

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self._http.aclose()

    async def _post(self, path: str, body: wire.BaseModel) -> dict:
        response = await self._http.post(path, json=body.model_dump(exclude_none=True))
        return _json_or_raise(response)

    async def generate(self, req: wire.GenerateRequest) -> wire.GenerateResponse:
        return wire.GenerateResponse.model_validate(await self._post("/generate", req))

    async def generate_batch(self, req: wire.BatchGenerateRequest) -> wire.BatchGenerateResponse:
        return wire.BatchGenerateResponse.model_validate(await self._post("/generate_batch", req))

    async def health(self) -> wire.HealthResponse:
        response = await self._http.get("/health")
        return wire.HealthResponse.model_validate(response.json())

    async def metrics_text(self) -> str:
        response = await self._http.get("/metrics")
        response.raise_for_status()
        return response.text


def _json_or_raise(response: httpx.Response) -> dict:
    if response.is_success:
        return response.json()
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text
    raise ServiceError(response.status_code, message)
