"""An ``SGLangEngine`` connected to the FAKE SGLang server (``fake_sglang``), for the SGLang
engine's unit tests (``tests/unit/rollout_service/test_sglang_{generate,stats,pushes,
server,conformance}.py``).

Runs in the test process: the engine talks to the fake's FastAPI app over httpx's ASGI
transport, no socket. Weight payloads are built by ``PayloadRecorder`` (SGLang's
serializer is not importable here). The ``checkpoint`` fixture (a folder holding only a
``config.json``) lives in ``tests/unit/rollout_service/conftest.py``.
"""

from __future__ import annotations

import json

import httpx

from rollout_service.engines.base import SamplingOptions, WeightUpdate
from rollout_service.engines.sglang.engine import SGLangEngine
from rollout_service.engines.sglang.http_client import HttpxServer
from rollout_service.engines.sglang.payload import push_segment
from rollout_service.engines.speculative import MTPSettings, build_sglang_server_args
from tests.support.fake_sglang import FakeSGLang

VERSIONS = ("0.5.10", "0.5.11", "0.5.12", "0.5.23")
MTP = MTPSettings(num_speculative_tokens=3)
SPEC_ARGS = build_sglang_server_args(MTP, {})  # EAGLE, 3 steps, topk 1, 4 draft tokens


class PayloadRecorder:
    """Stands in for SGLang's serializer (not importable here): JSON of our own data,
    after the same segment check as the real builder."""

    def __init__(self) -> None:
        self.calls: list[tuple[WeightUpdate, int]] = []

    def __call__(self, update: WeightUpdate, num_ranks: int) -> tuple[list[str], object]:
        self.calls.append((update, num_ranks))
        payload = json.dumps({"segment": push_segment(update),
                              "tensors": [p.model_dump() for p in update.tensors]})
        return [payload] * num_ranks, None


async def connect(fake: FakeSGLang, **kwargs: object) -> SGLangEngine:
    http = HttpxServer(httpx.AsyncClient(transport=httpx.ASGITransport(app=fake.app),
                                         base_url="http://fake"))
    return await SGLangEngine.connect("http://fake", served_model_name="tiny", http=http,
                                      payload_builder=kwargs.pop("payload_builder",
                                                                 PayloadRecorder()), **kwargs)


def make_fake(version: str, checkpoint: str, **kwargs: object) -> FakeSGLang:
    return FakeSGLang(version, model_path=checkpoint, speculative=SPEC_ARGS, **kwargs)


def greedy(max_tokens: int, **kwargs: object) -> SamplingOptions:
    return SamplingOptions(max_tokens=max_tokens, temperature=0.0, **kwargs)


def sent(fake: FakeSGLang, route: str) -> list[dict]:
    return [body for path, body in fake.calls if path == route]
