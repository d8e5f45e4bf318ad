"""What the SGLang engine learns from a running server when it connects: the
:class:`~rollout_service.engines.base.EngineInfo` the HTTP layer validates against, and
the server arguments its requests and pushes need.

Runs in the rollout service process; reads ``/model_info``, ``/server_info`` (SGLang's
server arguments), ``/v1/models``, the server's schema (``features.py``) and the served
checkpoint's ``config.json``. Older servers name the info routes ``/get_model_info`` and
``/get_server_info``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rollout_service.engines.base import EngineInfo, EngineUnavailableError
from rollout_service.engines.sglang.features import (
    INFO_TIMEOUT_S,
    ServerFeatures,
    detect_features,
)
from rollout_service.engines.sglang.http_client import ServerHTTP
from rollout_service.engines.speculative import load_checkpoint_config


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerFacts:
    """One server, as read at connect time."""

    info: EngineInfo
    features: ServerFeatures
    num_draft_tokens: int
    """``speculative_num_draft_tokens`` (0 without speculation)."""
    num_tp_ranks: int
    """``tp_size``: one push payload per rank."""
    base_gpu_id: int
    """SGLang's first GPU, where an ``nccl`` group's rank receives (``group_receiver.py``)."""
    is_text_streamed_as_delta: bool
    """``incremental_streaming_output``: a stream's events carry each step's text only."""


async def read_server(http: ServerHTTP, *, served_model_name: str,
                      model_path: str | None) -> ServerFacts:
    """The facts of the server ``http`` talks to.

    Args:
        model_path: the local checkpoint directory; None: the server's ``model_path``.

    Raises:
        EngineUnavailableError: the server cannot be reached, or an info route did not
            answer 200.
        ValueError: the checkpoint's config.json cannot be read.
    """
    model_info = await get_json(http, "/model_info", "/get_model_info")
    server_info = await get_json(http, "/server_info", "/get_server_info")
    models = await get_json(http, "/v1/models")
    features = await detect_features(http)
    model_path = model_path or model_info["model_path"]
    checkpoint = load_checkpoint_config(model_path)
    vocab_size = checkpoint.get("vocab_size") or checkpoint["text_config"]["vocab_size"]
    algorithm = server_info.get("speculative_algorithm")
    is_spec = algorithm is not None
    info = EngineInfo(
        model=served_model_name, engine="sglang", model_path=model_path,
        max_model_len=models["data"][0].get("max_model_len") or server_info["context_length"],
        vocab_size=vocab_size,
        # The longest acceptable chain: the accept-length and per-position range.
        num_speculative_tokens=server_info["speculative_num_steps"] if is_spec else 0,
        speculative_method=algorithm,
        has_pushable_drafter=has_pushable_drafter(
            server_info, {model_path, model_info.get("model_path")}),
        world_size=(server_info.get("tp_size") or 1) * (server_info.get("pp_size") or 1))
    return ServerFacts(
        info=info, features=features,
        num_draft_tokens=server_info["speculative_num_draft_tokens"] if is_spec else 0,
        num_tp_ranks=server_info.get("tp_size") or 1,
        base_gpu_id=server_info.get("base_gpu_id") or 0,
        is_text_streamed_as_delta=bool(server_info.get("incremental_streaming_output")))


def has_pushable_drafter(server_info: Mapping[str, Any], served: set[str | None]) -> bool:
    """Whether the server drafts with the served checkpoint's own MTP layers (EAGLE or
    NEXTN without a separate ``speculative_draft_model_path``; SGLang fills that path in
    with the model's for an MTP checkpoint), the only drafter a push can load. EAGLE3
    always drafts with a separate model.

    Args:
        server_info: the server's ``/server_info`` (its server arguments).
        served: the served checkpoint's paths (ours and the server's).
    """
    algorithm = server_info.get("speculative_algorithm")
    if algorithm is None or algorithm == "EAGLE3":
        return False
    return server_info.get("speculative_draft_model_path") in served | {None}


async def get_json(http: ServerHTTP, path: str, fallback: str | None = None) -> Any:
    """GET an info route; ``fallback`` is its older name (404 on the new one)."""
    reply = await http.send("GET", path, timeout=INFO_TIMEOUT_S)
    if reply.status == 404 and fallback is not None:
        reply = await http.send("GET", fallback, timeout=INFO_TIMEOUT_S)
    if reply.status != 200:
        raise EngineUnavailableError(f"SGLang {path} answered {reply.status}")
    return reply.json()
