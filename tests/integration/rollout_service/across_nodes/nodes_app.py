"""The app of the across-hosts tests (``test_serve_nodes.py``, ``test_serve_nodes_dialects.py``)
and what they read of it.

Two real vLLM CPU replicas on two nodes of a Ray cluster started here
(``rollout_service/tools/ray_cluster.py``: a head and two worker nodes, each its own
raylet and object store), pushes over the ``nccl`` transport with gloo standing in for
NCCL. One cluster and app for both modules (:func:`running_app` in ``conftest.py``'s
package-scoped fixture): a cluster start costs about 1.5 minutes on the 2-core machine.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch

from rollout_service.protocol import messages
from rollout_service.serve.config import parse_serve_config
from rollout_service.tools.ray_cluster import ServeOnNodes, serve_on_nodes
from tests.integration.conftest import (
    API_KEY,
    NUM_SPECULATIVE_TOKENS,
    RAY_REPLICA_OPTIONS,
    WEIGHTS_TOKEN,
)

BUCKET_BYTES = 1 << 20
GROUP_TIMEOUT_S = 30.0
MAIN_PARAM = "lm_head.weight"
DRAFT_PARAM = "model.mtp_layers.0.input_proj.weight"
HEADERS = {"authorization": f"Bearer {WEIGHTS_TOKEN}"}
API_HEADERS = {"authorization": f"Bearer {API_KEY}"}
CONFIG = {
    "model": "embedded:tiny",
    "mtp": {"num_speculative_tokens": NUM_SPECULATIVE_TOKENS},
    "api_key": API_KEY,
    "weights_token": WEIGHTS_TOKEN,
    "num_replicas": 2,
    "weights_transport": "nccl",
    "weights_bucket_bytes": BUCKET_BYTES,
    "weights_group_timeout_s": GROUP_TIMEOUT_S,
    "health_check_period_s": 1.0,
    "health_check_timeout_s": 10.0,
    "retry_timeout_s": 60.0,
    "push_ack_timeout_s": 120.0,
    "metrics_host": "127.0.0.1",
    "ray_actor_options": RAY_REPLICA_OPTIONS,
}


@contextmanager
def running_app(store_dir: Path) -> Iterator[ServeOnNodes]:
    """The cluster and the app, each replica's stored copies under ``store_dir`` (in a
    folder named for the replica)."""
    config = parse_serve_config({**CONFIG, "weights_store_dir": str(store_dir)})
    with serve_on_nodes(config, num_nodes=2) as running:
        yield running


def changed(original: dict[str, torch.Tensor], *names: str) -> dict[str, torch.Tensor]:
    return {**original, **{name: original[name] + 0.5 for name in names}}


def health(app: ServeOnNodes) -> dict:
    return httpx.get(f"{app.url}/health", timeout=60).json()


def checksums(app: ServeOnNodes) -> dict[str, dict[str, str]]:
    response = httpx.get(f"{app.url}/weights/checksums", headers=HEADERS, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def served(app: ServeOnNodes) -> messages.WeightStatus:
    response = httpx.get(f"{app.url}/weights/status", headers=HEADERS, timeout=60)
    return messages.WeightStatus.model_validate(response.json())


def group_state(app: ServeOnNodes) -> messages.WeightGroupState:
    response = httpx.get(f"{app.url}/weights/group/state", headers=HEADERS, timeout=60)
    return messages.WeightGroupState.model_validate(response.json())


def one_copy(app: ServeOnNodes) -> dict[str, str]:
    """Every replica's digests, which must be one and the same."""
    digests = checksums(app)
    assert len(digests) == 2 and len({tuple(sorted(d.items())) for d in digests.values()}) == 1
    return next(iter(digests.values()))


def current_replicas(app: ServeOnNodes) -> list[dict]:
    """``/health``'s replicas but those gone: a replica killed by an earlier test stays
    listed as gone, and its folder of stored copies stays on disk."""
    return [r for r in health(app)["replicas"] if r["status"] != "gone"]


def stored_copies(app: ServeOnNodes, store_dir: Path) -> dict[str, list[str]]:
    """Each current replica's stored-copy files, by replica (its folder's name)."""
    return {r["replica"]: sorted(p.name for p in (store_dir / r["replica"]).glob("push-*.bin"))
            for r in current_replicas(app)}
