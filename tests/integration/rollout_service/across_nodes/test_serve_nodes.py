"""Ray Serve across hosts: two real vLLM CPU replicas on two nodes of a Ray cluster
started here (``tools/ray_cluster.py``: a head and two worker nodes, each its own raylet
and object store), pushes over the ``nccl`` transport (gloo standing in for NCCL), the
trainer this test process (a driver of the cluster that talks only HTTP to the app) or a
spawned one where it must die.

One app for this folder (``conftest.py``); the tests run in order and each leaves both
replicas serving the same weights. What each checks: a push reaches both replicas with one
broadcast per bucket and touches no /dev/shm; a refused bucket or a trainer that dies mid-
broadcast loads nothing anywhere; a second trainer waits; a replica killed mid-update
leaves the other serving the old weights and its replacement takes the current version
from its peer's stored copy, without the trainer, before it serves.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from rollout_service.client import ServiceError
from rollout_service.embedded import ensure_model
from rollout_service.tools.ray_cluster import ServeOnNodes, replica_node_ids
from tests.integration.conftest import TARGET, WEIGHTS_TOKEN, wait_for
from tests.integration.rollout_service.across_nodes.nodes_app import (
    BUCKET_BYTES,
    DRAFT_PARAM,
    GROUP_TIMEOUT_S,
    MAIN_PARAM,
    changed,
    checksums,
    current_replicas,
    group_state,
    health,
    one_copy,
    served,
)
from tests.support.faulty_trainer import break_bucket, push_and_die
from tests.support.shm_usage import new_shm_files, process_tree
from trainer_client.push import WeightPusher

pytestmark = pytest.mark.skipif(TARGET.transport != "shm" or TARGET.tensor_device != "cpu",
                                reason="CPU replicas over gloo (the CPU target only)")


def trainer(app: ServeOnNodes, **options: object) -> WeightPusher:
    return WeightPusher(app.url, WEIGHTS_TOKEN, transport="nccl", bucket_bytes=BUCKET_BYTES,
                        **options)  # type: ignore[arg-type]


def test_the_replicas_sit_on_nodes_of_their_own(app: ServeOnNodes) -> None:
    nodes = replica_node_ids("rollout")
    assert len(nodes) == 2 and len(set(nodes.values())) == 2
    assert set(nodes.values()) <= set(app.node_ids)


def test_a_push_reaches_both_replicas_in_one_broadcast_per_bucket(
        app: ServeOnNodes, original: dict[str, torch.Tensor]) -> None:
    baseline = one_copy(app)
    in_push = [os.getpid(), *(pid for replica in current_replicas(app)
                              for pid in process_tree(replica["pid"]))]
    group = group_state(app)
    assert group.num_ranks == 2 and group.current is None
    version = served(app).newest_version + 1
    with trainer(app) as pusher, new_shm_files(lambda: in_push) as shm_usage:
        report = pusher.push(changed(original, MAIN_PARAM, DRAFT_PARAM).items(),
                             version=version)
        assert sorted(report.server.replicas or ()) == sorted(checksums(app))
        assert report.num_buckets == 5
        peaks = report.server.receive_peak_bytes
        assert peaks and len(peaks) == 2 and all(p <= 2 * BUCKET_BYTES for p in peaks), peaks
        moved = one_copy(app)
        assert moved["main"] != baseline["main"] and moved["draft"] != baseline["draft"]
        state = served(app)
        assert (state.main_version, state.draft_version) == (version, version)
        pusher.push(original.items(), version=version + 1)
    assert one_copy(app) == baseline
    # neither the trainer nor a replica's processes touched /dev/shm
    assert not shm_usage.new, shm_usage.new


def test_a_refused_bucket_loads_nothing_on_any_replica(
        app: ServeOnNodes, original: dict[str, torch.Tensor]) -> None:
    before, state = one_copy(app), served(app)
    with trainer(app) as pusher:
        break_bucket(pusher, "short", index=1)
        with pytest.raises(ServiceError, match="bucket 1") as info:
            pusher.push(changed(original, MAIN_PARAM).items(), version=state.newest_version + 1)
        assert info.value.status == 400
    assert one_copy(app) == before
    after = served(app)
    assert (after.main_version, after.draft_version) == (state.main_version,
                                                          state.draft_version)


def test_a_trainer_that_dies_mid_broadcast_loads_nothing_anywhere(
        app: ServeOnNodes, original: dict[str, torch.Tensor]) -> None:
    before, state = one_copy(app), served(app)
    dying = multiprocessing.get_context("spawn").Process(target=push_and_die, args=(
        app.url, WEIGHTS_TOKEN, str(Path(ensure_model("tiny")) / "model.safetensors"),
        state.newest_version + 1, 2, BUCKET_BYTES))
    dying.start()
    dying.join(300)
    assert dying.exitcode == 3
    died = time.monotonic()
    after = wait_for(lambda: served(app), lambda s: s.active_push_id is None
                     and s.last_push is not None
                     and s.last_push.version == state.newest_version + 1, timeout_s=180)
    assert time.monotonic() - died < GROUP_TIMEOUT_S  # the connections closed at once
    assert after.last_push.outcome == "failed"
    assert one_copy(app) == before
    with trainer(app) as pusher:  # a new group; the next push loads everywhere
        pusher.push(changed(original, MAIN_PARAM).items(), version=state.newest_version + 2)
        assert one_copy(app)["main"] != before["main"]
        pusher.push(original.items(), version=state.newest_version + 3)
    assert one_copy(app) == before


def test_a_second_trainer_is_refused_while_the_first_owns_the_group(
        app: ServeOnNodes, original: dict[str, torch.Tensor]) -> None:
    with trainer(app) as first, trainer(app) as second:
        first.push(original.items(), version=served(app).newest_version + 1)
        with pytest.raises(ServiceError, match="group_id: the deployment is in group") as info:
            second.push(original.items(), version=served(app).newest_version + 1)
        assert info.value.status == 409


def test_a_replica_killed_mid_update_leaves_the_old_weights_and_catches_up_from_its_peer(
        app: ServeOnNodes, original: dict[str, torch.Tensor]) -> None:
    """During the third bucket's update one replica's process is killed: the push fails,
    no replica loads anything, the other serves on with the old weights, and the replica
    Serve starts in its place takes the current version from its peer's stored copy
    (checked bucket by bucket against the trainer's checksums) before it takes a
    request; the next push, in a group sized for the replicas then serving, loads on
    both."""
    with trainer(app) as pusher:
        pusher.push(changed(original, DRAFT_PARAM).items(),
                    version=served(app).newest_version + 1)
    before, state = one_copy(app), served(app)
    replicas = current_replicas(app)
    victim, survivor = replicas[0], replicas[1]
    with trainer(app) as pusher:
        group = pusher._group
        assert group is not None
        honest = group.during_update

        def kill_then_send(key: str, payload: torch.Tensor, *, index: int, checksum: int,
                           update: object) -> object:
            if index == 2:
                os.kill(victim["pid"], signal.SIGKILL)
            return honest(key, payload, index=index, checksum=checksum,
                          update=update)  # type: ignore[arg-type]

        group.during_update = kill_then_send  # type: ignore[method-assign]
        killed = time.monotonic()
        with pytest.raises((ServiceError, RuntimeError)):
            pusher.push(changed(original, MAIN_PARAM).items(), version=state.newest_version + 1)
        # the group was closed on the survivor when its peer went (not at its timeout)
        assert time.monotonic() - killed < GROUP_TIMEOUT_S
    still = checksums(app)
    assert still[survivor["replica"]] == before  # nothing loaded on the replica left
    after = served(app)
    assert (after.main_version, after.draft_version) == (state.main_version,
                                                          state.draft_version)
    restored = wait_for(lambda: health(app), lambda h: h["status"] == "ok" and victim[
        "replica"] not in {r["replica"] for r in h["replicas"] if r["status"] != "gone"},
        timeout_s=900, interval_s=1.0)
    recovered_s = time.monotonic() - killed
    print(f"replica killed mid-update: serving again after {recovered_s:.1f} s")
    newcomer = next(r for r in restored["replicas"]
                    if r["status"] == "ok" and r["replica"] != survivor["replica"])
    assert (newcomer["main_version"], newcomer["draft_version"]) == (state.main_version,
                                                                      state.draft_version)
    assert one_copy(app) == before  # the peer's copy, loaded bit for bit
    with trainer(app) as pusher:
        pusher.push(original.items(), version=state.newest_version + 2)
    assert len(checksums(app)) == 2
