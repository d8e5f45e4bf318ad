"""The speculation controller under Ray Serve: each replica runs its own, and the
ingress's ``/health`` shows each one's state, live.

Real Ray, one real vLLM CPU engine replica with ``speculation_control.enabled``, started
as a user starts it (``rollout-service serve-ray``). An app of its own: test_serve.py's
runs without the control, so that its acceptance tests keep a fixed K.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from rollout_service.client import RolloutClient
from rollout_service.protocol import messages
from rollout_service.tools.launch import ServiceProcess
from tests.integration.conftest import (
    API_KEY,
    NUM_SPECULATIVE_TOKENS,
    RAY_REPLICA_OPTIONS,
    WEIGHTS_TOKEN,
    run_ray_service,
    until,
)

BUCKETS = [1, 2, 4]
CONFIG = {
    "model": "embedded:tiny",
    "mtp": {"num_speculative_tokens": NUM_SPECULATIVE_TOKENS},
    "api_key": API_KEY,
    "weights_token": WEIGHTS_TOKEN,
    "num_replicas": 1,
    "health_check_period_s": 1.0,
    "health_check_timeout_s": 10.0,
    "metrics_host": "127.0.0.1",
    "ray_actor_options": RAY_REPLICA_OPTIONS,
    "speculation_control": {
        "enabled": True, "batch_size_buckets": BUCKETS,
        "calibration": {"max_batch_size": 2, "num_steps": 4, "prompt_tokens": 16}},
}


@pytest.fixture(scope="module")
def ray_controlled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    """``rollout-service serve-ray``, one replica with the speculation control, serving."""
    with run_ray_service(tmp_path_factory.mktemp("ray_controlled"), CONFIG) as proc:
        yield proc


async def test_health_shows_each_replicas_controller_live(
        ray_controlled: ServiceProcess) -> None:
    async with RolloutClient(ray_controlled.url, api_key=API_KEY) as client:
        body = await client.health()
        (replica,) = body.replicas or []
        control = replica.speculation_control
        assert control is not None, "the replica reports no controller"
        assert control.k_max == NUM_SPECULATIVE_TOKENS
        assert [b.batch_size for b in control.buckets] == BUCKETS
        assert control.calibration_s is not None and control.cost_table  # calibrated at start
        assert body.speculation_control == control  # the serving replica speaks for all
        # Finished sequences reach the replica's controller, and /health shows it.
        seen = control.num_observations
        await asyncio.gather(*(client.generate(messages.GenerateRequest(
            prompt_token_ids=[5 + i, 17, 42], max_tokens=8, temperature=0.0))
            for i in range(4)))

        async def observations() -> int:
            (state,) = (await client.health()).replicas or []
            assert state.speculation_control is not None
            return state.speculation_control.num_observations

        await until(observations, lambda n: n >= seen + 4, timeout_s=60)
