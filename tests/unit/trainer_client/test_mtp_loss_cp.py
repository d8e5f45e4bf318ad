"""MTP loss under context parallelism: 2 CPU processes over gloo, CP = 2.

Each test spawns two ranks. Every worker reports its own failure to the parent (a
traceback through ``torch.multiprocessing``); the parent also gives up after a timeout
and kills the ranks, so a collective that one rank skips shows up as a failed test
instead of a hung suite (verl #5895 deadlocked exactly there).
"""

from __future__ import annotations

import datetime
import queue
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.support.spawned import rendezvous_address
from trainer_client.mtp_loss import MTPLossConfig, mtp_depth_losses, reduce_for_logging
from trainer_client.padding import zigzag_split, zigzag_split_packed
from trainer_client.roll import roll_left

CP = 2
STARTUP_TIMEOUT_S = 120.0


class RanksTimedOut(Exception):
    """The ranks started but did not all finish within the timeout: a hang."""


def run_ranks(fn, *args, timeout_s: float) -> None:
    """Run ``fn(rank, address, ready, *args)`` on CP ranks; fail if they do not finish in time.

    ``timeout_s`` counts from the moment every rank has joined the process group (each
    puts its rank on ``ready``), so slow interpreter start-up on a busy machine is not
    mistaken for a hang.

    Raises:
        RanksTimedOut: the ranks were up but did not all finish within ``timeout_s``.
        torch.multiprocessing.ProcessRaisedException: a rank raised (its traceback).
    """
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    procs = mp.start_processes(fn, args=(rendezvous_address(), ready, *args), nprocs=CP, join=False,
                               start_method="spawn")
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        num_ready = 0
        while num_ready < CP:
            try:
                ready.get(timeout=0.2)
                num_ready += 1
            except queue.Empty:
                if procs.join(timeout=0):  # raises if a rank failed before joining
                    pytest.fail("ranks exited before all of them joined the process group")
                if time.monotonic() > deadline:
                    pytest.fail(f"ranks did not start within {STARTUP_TIMEOUT_S} s")
        deadline = time.monotonic() + timeout_s
        while not procs.join(timeout=0.2):
            if time.monotonic() > deadline:
                alive = [rank for rank, p in enumerate(procs.processes) if p.is_alive()]
                raise RanksTimedOut(f"ranks {alive} still running after {timeout_s} s")
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.kill()
            p.join()


def _init(rank: int, address: str, ready, timeout_s: float = 60.0) -> None:
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=address, rank=rank,
                            world_size=CP, timeout=datetime.timedelta(seconds=timeout_s))
    ready.put(rank)


def _data(seed: int, *, batch: int = 2, seq: int = 16, hidden_size: int = 6, vocab: int = 11,
          num_depths: int = 2) -> dict:
    """The full (unsplit) problem, identical on every rank."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, seq, dtype=torch.float64)
    mask[0, :5] = 0.0  # prompt
    mask[1, :3] = 0.0
    mask[:, -2:] = 0.0  # end of sequence / padding
    mask[1, 9] = 0.0  # a tool output inside the response
    return {
        "hidden": [torch.randn(seq, batch, hidden_size, generator=gen, dtype=torch.float64)
                   for _ in range(num_depths)],
        "labels": torch.randint(0, vocab, (batch, seq), generator=gen),
        "mask": mask,
        "weight": torch.randn(vocab, hidden_size, generator=gen, dtype=torch.float64),
        "bias": torch.randn(vocab, generator=gen, dtype=torch.float64),
    }


def _expected_log(data: dict, cfg: MTPLossConfig) -> dict[str, float]:
    """What the source rank must log: the single-process computation on the whole data."""
    out = {}
    for depth in mtp_depth_losses(data["hidden"], data["labels"], data["mask"], data["weight"],
                                  data["bias"], cfg):
        out[f"mtp_{depth.depth}_loss"] = float(depth.loss_sum) / max(float(depth.num_tokens), 1)
        out[f"mtp_{depth.depth}_num_tokens"] = float(depth.num_tokens)
        out[f"mtp_{depth.depth}_accuracy"] = float(depth.num_correct) / max(
            float(depth.num_tokens), 1)
    return out


# --------------------------------------------------------------------------- workers

def _check_zigzag_shards(rank: int) -> None:
    """Zigzag shards: CP-aware rolling, then the logged sums equal the unsplit ones."""
    from trainer_client.megatron.cpu_compat import megatron_on_cpu

    group = dist.group.WORLD
    data = _data(seed=7)
    cfg = MTPLossConfig(num_layers=2)
    with megatron_on_cpu():  # roll_tensor's CP path allocates on the current CUDA device
        # Rolling a shard with the CP group equals rolling the whole sequence, then splitting.
        for k in (1, 2, 3):
            for full in (data["labels"], data["mask"]):
                got = roll_left(zigzag_split(full, CP, dim=1)[rank], k, cp_group=group)
                assert torch.equal(got, zigzag_split(roll_left(full, k), CP, dim=1)[rank]), k
        # Packed rows (THD): each sequence is split and rolled on its own.
        bounds = torch.tensor([0, 8, 12, 24])
        row = torch.arange(1, 25).view(1, 24)
        got = roll_left(zigzag_split_packed(row, bounds, CP, rank), 1, cp_group=group,
                        cu_seqlens=bounds)
        want = zigzag_split_packed(roll_left(row, 1, cu_seqlens=bounds), bounds, CP, rank)
        assert torch.equal(got, want), (got, want)

        losses = mtp_depth_losses(
            [zigzag_split(h, CP, dim=0)[rank] for h in data["hidden"]],
            zigzag_split(data["labels"], CP, dim=1)[rank],
            zigzag_split(data["mask"], CP, dim=1)[rank],
            data["weight"], data["bias"], cfg, cp_group=group)
    logged = reduce_for_logging(losses, groups=[group], is_source_rank=rank == 0)
    if rank == 0:
        assert logged == pytest.approx(_expected_log(data, cfg), rel=1e-12)
    else:
        assert logged is None


def _worker(rank: int, address: str, ready, step_done, *, zigzag: bool,
            skip_on_rank_1: bool) -> None:
    """Optionally the zigzag checks, then three training steps where only rank 0 logs.

    ``skip_on_rank_1`` reproduces verl's bug: the collective gated on ``cp_rank == 0``.
    """
    _init(rank, address, ready, timeout_s=300.0)
    if zigzag:
        _check_zigzag_shards(rank)
    cfg = MTPLossConfig(num_layers=2)
    for step in range(3):
        data = _data(seed=100 + step)
        # Each rank holds one of the two sequences (no roll across ranks needed here).
        losses = mtp_depth_losses([h[:, rank:rank + 1] for h in data["hidden"]],
                                  data["labels"][rank:rank + 1], data["mask"][rank:rank + 1],
                                  data["weight"], data["bias"], cfg)
        if skip_on_rank_1 and rank != 0:
            logged = None
        else:
            logged = reduce_for_logging(losses, groups=[None], is_source_rank=rank == 0)
        if rank == 0:
            assert logged == pytest.approx(_expected_log(data, cfg), rel=1e-12)
        else:
            assert logged is None
        # The rest of the step (backward, optimizer) waits for every rank.
        step_done.wait()
    dist.destroy_process_group()


def _zigzag_then_steps(rank: int, address: str, ready, step_done) -> None:
    _worker(rank, address, ready, step_done, zigzag=True, skip_on_rank_1=False)


def _steps_skipping_rank_1(rank: int, address: str, ready, step_done) -> None:
    _worker(rank, address, ready, step_done, zigzag=False, skip_on_rank_1=True)


# --------------------------------------------------------------------------- tests

@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="CPU-only: with CUDA present megatron's roll_tensor puts its CP "
                           "buffers on the GPU, which these gloo ranks cannot send")
def test_source_rank_logs_global_sums_and_no_rank_hangs() -> None:
    """Zigzag shards with megatron-core's roll_tensor: the source rank gets the sums of
    the unsplit problem, the other None; then three steps in which every rank calls the
    collective finish well inside the 60 s timeout (no deadlock)."""
    pytest.importorskip("megatron.core")
    barrier = mp.get_context("spawn").Barrier(CP)
    run_ranks(_zigzag_then_steps, barrier, timeout_s=60.0)


@pytest.mark.xfail(strict=True, raises=RanksTimedOut,
                   reason="expected to hang: rank 1 skips the all-reduce (verl #5895)")
def test_skipping_the_collective_on_one_rank_hangs() -> None:
    """The same steps with the collective gated on rank 0: rank 0 waits in the all-reduce
    for rank 1, which waits for rank 0 at the end of the step. The harness turns the
    deadlock into RanksTimedOut after 5 s (counted once both ranks are up); strict xfail
    fails the suite if this ever completes."""
    barrier = mp.get_context("spawn").Barrier(CP)
    run_ranks(_steps_skipping_rank_1, barrier, timeout_s=5.0)
