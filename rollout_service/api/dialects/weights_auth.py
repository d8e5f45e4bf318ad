"""Who may call the dialects' weight routes (SGLang's ``/init_weights_update_group``...,
vLLM's ``/init_weight_transfer_engine``...).

Runs in the service process. These routes change the served weights, as ``/weights/*``
do, so they take the same secret: the service's weights token, as SGLang takes its
``admin_api_key`` on them when one is set (sgl-project/sglang 0.5.23
``python/sglang/srt/utils/auth.py``, ``AuthLevel.ADMIN_OPTIONAL``). The frameworks'
clients set no header on these calls (SkyRL 0.4.0 ``weight_sync/control_plane.py``,
vLLM's ``HTTPVLLMWeightSyncClient``, AReaL's ``RemoteInfEngine``), but they send the
credentials of their server URL: ``http://user:TOKEN@host:port`` reaches the service as
HTTP Basic auth (``requests`` and ``aiohttp`` both do it), so the token is taken as a
bearer token or as the Basic password. slime builds its URLs from a host and a port and
can send nothing: ``dialect_weights_auth: none`` opens the routes, for a service behind
the same network boundary as the engine it replaces (SGLang's default).
"""

from __future__ import annotations

import base64
import binascii
import secrets
from collections.abc import Awaitable, Callable

from fastapi import Request

from rollout_service.api.errors import Forbidden, Unauthorized

HOW = ("pass the service's weights token as 'Authorization: Bearer <token>', or in the "
       "server URL the framework is given (http://weights:<token>@host:port, sent as HTTP "
       "Basic auth)")


def dialect_weights_guard(weights_token: str | None, mode: str
                          ) -> Callable[[Request], Awaitable[None]] | None:
    """The dependency of the dialects' weight routes; None when they are open (``mode``
    ``none``)."""
    if mode == "none":
        return None

    async def guard(request: Request) -> None:
        if weights_token is None:
            raise Forbidden("weight pushes are disabled: no weights token is configured "
                            "(weights_token, weights_token_file or $ROLLOUT_WEIGHTS_TOKEN; "
                            "or dialect_weights_auth: none for clients that send none)")
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "basic":
            try:
                given = base64.b64decode(given, validate=True).decode().partition(":")[2]
            except (binascii.Error, UnicodeDecodeError):
                given = ""
        elif scheme.lower() != "bearer":
            given = ""
        if not given or not secrets.compare_digest(given.encode(), weights_token.encode()):
            raise Unauthorized(f"missing or wrong weights token: {HOW}")

    return guard
