"""The Ray Serve deployment's ``/health``, composed from its replicas' own reports.

Each replica runs its own speculation controller on its own batches, so ``/health`` lists
every replica's K schedule and surfaces a serving replica's at the top; a replica that
does not serve (lagging, starting, gone) must not speak for the deployment.
"""

from __future__ import annotations

import pytest

from rollout_service.protocol import messages
from rollout_service.protocol.speculation import BucketStatus, SpeculationControlStatus
from rollout_service.serve.app import deployment_health
from rollout_service.serve.config import RayServeConfig

CONFIG = RayServeConfig(model="embedded:tiny", num_replicas=2)
WEIGHTS = messages.WeightStatus(main_version=3, draft_version=3, active_push_id=None,
                                consistent=True, last_push=None)


def control(k: int) -> SpeculationControlStatus:
    """A controller running ``k`` draft tokens at batch size 1 (its reason says so)."""
    bucket = BucketStatus(batch_size=1, k=k, reason=f"runs {k}", controller_k=k,
                          tokens_per_s=[None] * 3)
    return SpeculationControlStatus(
        k_max=2, buckets=[bucket], is_collapsed=k == 0, is_probing=False, collapse_rate=None,
        acceptance=[], draft_version=3, num_observations=0, last_batch_size=None, pinned=None,
        engine_schedule=None, cost_table=[], calibration_s=None, num_applied=0,
        num_refused=0, last_error=None)


def replica(name: str, status: messages.ReplicaStatus, k: int | None) -> messages.ReplicaHealth:
    return messages.ReplicaHealth(replica=name, status=status, main_version=3, draft_version=3,
                                  speculation_control=None if k is None else control(k))


def test_every_replica_reports_its_own_controller_and_a_serving_one_speaks_for_all() -> None:
    replicas = [replica("a", "lagging", 0), replica("b", "ok", 2), replica("c", "ok", 1)]
    body, code = deployment_health(CONFIG, replicas, WEIGHTS, num_wanted=2)
    assert code == 200 and body.status == "degraded"  # a lags
    assert body.speculation_control == control(2)  # the first serving one, not the lagging
    assert [r.speculation_control for r in body.replicas] == [control(0), control(2),
                                                              control(1)]


@pytest.mark.parametrize("statuses,want", [
    (("ok", "ok"), ("ok", 200)),
    (("ok", "gone"), ("ok", 200)),  # a stopped replica is not counted
    (("ok", "starting"), ("degraded", 200)),
    (("unavailable", "lagging"), ("unavailable", 503)),
])
def test_status_and_code_follow_the_serving_replicas(statuses: tuple[str, ...],
                                                     want: tuple[str, int]) -> None:
    replicas = [replica(f"r{i}", s, None) for i, s in enumerate(statuses)]  # type: ignore[arg-type]
    body, code = deployment_health(CONFIG, replicas, WEIGHTS, num_wanted=1)
    assert (body.status, code) == want
    assert body.speculation_control is None  # the control is off on every replica
    if want[0] != "ok":
        assert body.detail and all(f"{r.replica}: {r.status}" in body.detail
                                   for r in replicas if r.status not in ("ok", "gone"))
