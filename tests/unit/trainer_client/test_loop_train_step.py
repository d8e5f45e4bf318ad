"""The RL loop's training step keeps the MTP loss out of the policy's weights (CPU).

``loop.train_step`` on the tiny model (megatron-core 0.16 on CPU, a spawned process)
with a policy loss that is identically zero: the only gradient is the MTP loss's. With
``MTPLossConfig``'s default ``detach_trunk`` every parameter outside the MTP block must
come out of the Adam step unchanged, and every MTP parameter must move.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from tests.support.spawned import rendezvous_address, run_spawned
from tests.unit.trainer_client.test_mtp_forward import tiny_config


def zero_policy_loss(per_token_ce: torch.Tensor, batch: object) -> torch.Tensor:
    """A policy loss with a graph and no gradient: isolates the MTP loss's."""
    del batch
    return (per_token_ce * 0.0).sum()


def check_train_step_moves_only_the_mtp_layers() -> None:
    from trainer_client.batch import Rollout, pack_padded
    from trainer_client.loop import LoopConfig, train_step
    from trainer_client.megatron.model import build_gpt_mtp_model
    from trainer_client.mtp_loss import set_mtp_loss_backward_scale

    config = tiny_config()
    torch.manual_seed(0)
    model = build_gpt_mtp_model(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    set_mtp_loss_backward_scale(1.0)
    gen = torch.Generator().manual_seed(0)
    rollouts = [Rollout(prompt_ids=torch.randint(1, 500, (4,), generator=gen).tolist(),
                        response_ids=torch.randint(1, 500, (n,), generator=gen).tolist(),
                        reward=float(n)) for n in (6, 9)]
    batch = pack_padded(rollouts, tp=1, cp=1, pad_id=0)
    cfg = LoopConfig(service_url="http://unused", checkpoint=Path("unused"), weights_token="t")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    losses = train_step(model, optimizer, batch, config, cfg, zero_policy_loss)
    assert all(loss > 0 for loss in losses.mtp)
    moved = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    trunk_moved = sorted(name for name in moved if not name.startswith("mtp."))
    assert not trunk_moved, f"the MTP loss moved the policy: {trunk_moved}"
    mtp_names = {name for name in before if name.startswith("mtp.")}
    assert moved == mtp_names, sorted(mtp_names - moved)


def _worker(address: str, errors: object) -> None:
    try:
        warnings.filterwarnings("ignore")
        torch.set_num_threads(2)
        from trainer_client.megatron.model import init_parallel_cpu

        with init_parallel_cpu(init_method=address):
            check_train_step_moves_only_the_mtp_layers()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent with its traceback
        import traceback
        errors.put(f"{exc!r}\n{traceback.format_exc()}")
        return
    errors.put(None)


def test_train_step_with_the_default_config_moves_only_the_mtp_layers() -> None:
    pytest.importorskip("megatron.core")
    run_spawned(_worker, rendezvous_address(), timeout_s=300)
