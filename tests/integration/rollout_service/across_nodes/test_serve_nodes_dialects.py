"""The frameworks' weight syncs through the Ray Serve ingress, across hosts: two real vLLM
CPU replicas on two nodes of a Ray cluster started here (``nodes_app.py``), the trainer
this test process calling the dialects' routes on the ingress as its framework does
(``framework_trainers.py``), gloo standing in for NCCL.

One app for this folder (``conftest.py``); the tests run in order and each leaves both
replicas serving the same weights. What each checks: slime's sync (SGLang's routes, its
torch group) reaches both replicas and commits at ``/continue_generation``, the version in
``/get_weight_version`` and ``/weights/status``, no process of the push touching /dev/shm;
a refused update (a wrong shape) loads nothing on either replica, and what arrived of it
leaves no file behind; vLLM's trainer engine with SkyRL's drafter session (vLLM's routes,
the PyNccl stand-in) loads the main model, then the drafter, on both; a replica that
restarts after a framework's sync takes it from its peer's stored copy, checked by the
checksums its holders computed as the unchecksummed buckets arrived.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import torch

from rollout_service.tools.ray_cluster import ServeOnNodes
from tests.integration.conftest import API_KEY, TARGET, WEIGHTS_TOKEN, wait_for
from tests.integration.rollout_service.across_nodes.nodes_app import (
    API_HEADERS,
    DRAFT_PARAM,
    MAIN_PARAM,
    changed,
    checksums,
    current_replicas,
    group_state,
    health,
    one_copy,
    served,
    stored_copies,
)
from tests.integration.rollout_service.framework_trainers import (
    SGLangTrainer,
    VLLMTrainer,
    drafter_tensors,
)
from tests.support.shm_usage import new_shm_files, process_tree

pytestmark = pytest.mark.skipif(TARGET.transport != "shm" or TARGET.tensor_device != "cpu",
                                reason="CPU replicas over gloo (the CPU target only)")


def slime(app: ServeOnNodes) -> SGLangTrainer:
    """slime's trainer, its world every serving replica's ranks and its own."""
    return SGLangTrainer(app.url, weights_token=WEIGHTS_TOKEN, api_key=API_KEY,
                         world_size=1 + group_state(app).num_ranks)


def sglang_version(app: ServeOnNodes) -> str:
    return httpx.get(f"{app.url}/get_weight_version", headers=API_HEADERS,
                     timeout=60).json()["weight_version"]


def replica_versions(app: ServeOnNodes) -> set[tuple[int | None, int | None]]:
    return {(r["main_version"], r["draft_version"]) for r in current_replicas(app)}


def test_a_slime_sync_through_the_ingress_loads_on_both_replicas(
        app: ServeOnNodes, original: dict[str, torch.Tensor], stores: Path) -> None:
    baseline = one_copy(app)
    version = served(app).newest_version + 1
    in_push = [os.getpid(), *(pid for replica in current_replicas(app)
                              for pid in process_tree(replica["pid"]))]
    trainer = slime(app)
    assert trainer.init_answer.status_code == 200, trainer.init_answer.text
    with new_shm_files(lambda: in_push) as shm_usage:
        answer = trainer.sync(changed(original, MAIN_PARAM, DRAFT_PARAM), version=version)
        assert answer.status_code == 200, answer.text
        moved = one_copy(app)
        assert moved["main"] != baseline["main"] and moved["draft"] != baseline["draft"]
        state = served(app)
        assert (state.main_version, state.draft_version) == (version, version)
        assert replica_versions(app) == {(version, version)}
        assert sglang_version(app) == str(version)
        answer = trainer.sync(original, version=version + 1)
        assert answer.status_code == 200, answer.text
    assert one_copy(app) == baseline
    assert sglang_version(app) == str(version + 1)
    assert trainer.destroy().json()["success"] is True
    assert group_state(app).current is None
    assert not shm_usage.new, shm_usage.new  # neither the trainer nor a replica's processes
    assert all(len(files) == 1 for files in stored_copies(app, stores).values())


def test_a_refused_update_loads_nothing_on_either_replica(
        app: ServeOnNodes, original: dict[str, torch.Tensor], stores: Path) -> None:
    """A tensor of the wrong shape: refused (400 naming it) before anything loads, on both
    replicas; the next sync loads on both, and no replica keeps a file of the refused one."""
    before, state = one_copy(app), served(app)
    trainer = slime(app)
    trainer.pause()
    answer = trainer.update([(MAIN_PARAM, original[MAIN_PARAM][:-1].clone())],
                            version=state.newest_version + 1)
    assert answer.status_code == 400 and answer.json()["success"] is False, answer.text
    assert MAIN_PARAM in answer.json()["message"] and "has" in answer.json()["message"]
    assert trainer.resume().status_code == 200
    assert one_copy(app) == before
    after = served(app)
    assert (after.main_version, after.draft_version) == (state.main_version,
                                                          state.draft_version)
    assert after.last_push is not None and after.last_push.outcome == "rejected"
    answer = trainer.sync(original, version=state.newest_version + 1)
    assert answer.status_code == 200, answer.text
    assert replica_versions(app) == {(state.newest_version + 1,) * 2}
    assert all(len(files) == 1 for files in stored_copies(app, stores).values()), \
        stored_copies(app, stores)
    trainer.destroy()


def test_a_skyrl_sync_through_the_ingress_loads_main_then_drafter_on_both(
        app: ServeOnNodes, original: dict[str, torch.Tensor]) -> None:
    baseline, state = one_copy(app), served(app)
    trainer = VLLMTrainer(app.url, weights_token=WEIGHTS_TOKEN,
                          world_size=1 + group_state(app).num_ranks)
    new = changed(original, MAIN_PARAM, DRAFT_PARAM)
    trainer.send_weights(new)
    version = state.newest_version + 1
    after_main = one_copy(app)
    assert after_main["main"] != baseline["main"] and after_main["draft"] == baseline["draft"]
    assert replica_versions(app) == {(version, state.draft_version)}
    trainer.send_weights(drafter_tensors(new), draft=True)
    assert one_copy(app)["draft"] != baseline["draft"]
    assert replica_versions(app) == {(version, version)}
    trainer.send_weights(original, weight_version=str(version + 5))
    trainer.send_weights(drafter_tensors(original), draft=True)
    assert one_copy(app) == baseline
    assert replica_versions(app) == {(version + 5, version + 5)}
    trainer.client._post("shutdown_weight_transfer_engine")
    assert group_state(app).current is None


def test_a_replica_restarted_after_a_sync_takes_it_from_its_peer(
        app: ServeOnNodes, original: dict[str, torch.Tensor]) -> None:
    """After slime's sync (buckets without checksums) one replica's process is killed:
    the replica Serve starts in its place fetches its peer's stored copy, each bucket
    checked by the checksum the holders' writers computed on arrival, and serves the
    sync's weights and version before it takes a request."""
    trainer = slime(app)
    version = served(app).newest_version + 1
    answer = trainer.sync(changed(original, MAIN_PARAM, DRAFT_PARAM), version=version)
    assert answer.status_code == 200, answer.text
    trainer.destroy()
    synced = one_copy(app)
    victim = current_replicas(app)[0]
    os.kill(victim["pid"], signal.SIGKILL)
    killed = time.monotonic()

    def replaced(h: dict) -> bool:  # the victim gone, its successor past its start
        current = [r for r in h["replicas"] if r["status"] != "gone"]
        return len(current) == 2 and victim["replica"] not in {r["replica"] for r in current} \
            and all(r["status"] != "starting" for r in current)

    restored = wait_for(lambda: health(app), replaced, timeout_s=900, interval_s=1.0)
    print(f"replica killed after a sync: serving again after {time.monotonic() - killed:.1f} s")
    assert restored["status"] == "ok", restored  # a replica that could not catch up lags
    assert replica_versions(app) == {(version, version)}
    assert one_copy(app) == synced  # the peer's copy, loaded bit for bit
    trainer = slime(app)  # back to the original, on both
    answer = trainer.sync(original, version=version + 1)
    assert answer.status_code == 200, answer.text
    trainer.destroy()
    assert len(checksums(app)) == 2
