"""The RL loop against the session's real service: generate, train, push, three steps.

Runs the trainer (megatron-core on CPU, gloo) in the pytest process and the service
from ``tests/integration/conftest.py``. Each run pushes new weights; the ``restore`` fixture pushes
the checkpoint back (with a newer version) so later tests see the original model.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollout_service.embedded import ensure_model
from rollout_service.embedded.corpus import arithmetic_prompts
from rollout_service.tools.launch import ServiceProcess
from tests.integration.conftest import API_KEY, WEIGHTS_TOKEN, served_version
from tests.integration.conftest import weights_checksums as checksums
from tests.integration.conftest import weights_status as status
from trainer_client.batch import Rollout, pack_padded
from trainer_client.loop import LoopConfig, StepLog, policy_gradient_loss, run_loop
from trainer_client.push import WeightPusher
from trainer_client.task import reward

pytest.importorskip("vllm", reason="needs the vLLM engine (the service or the drafter)")

NUM_STEPS = 3


@pytest.fixture
def restore(service: ServiceProcess) -> Iterator[None]:
    before = checksums(service)
    yield
    original = load_file(str(Path(ensure_model("tiny")) / "model.safetensors"))
    with WeightPusher(service.url, WEIGHTS_TOKEN) as pusher:
        pusher.push(original.items(), version=served_version(service) + 1, target="both")
    assert checksums(service) == before


def test_reward_is_the_answer_or_the_digit_share() -> None:
    assert reward(" 19 and more", "19") == 1.0
    assert reward("a1b2", "7") == 0.5
    assert reward("", "7") == 0.0


@pytest.mark.parametrize("sync_drafter", [True, False], ids=["synced", "main-only"])
def test_loop_trains_and_pushes_every_step(service: ServiceProcess, restore: None,
                                           sync_drafter: bool) -> None:
    start = status(service)
    first = served_version(service)
    cfg = LoopConfig(service_url=service.url, checkpoint=Path(ensure_model("tiny")),
                     weights_token=WEIGHTS_TOKEN, api_key=API_KEY, num_steps=NUM_STEPS,
                     batch_size=4, max_tokens=16, lr=1e-3, sync_drafter=sync_drafter)
    logged: list[StepLog] = []
    history = run_loop(cfg, arithmetic_prompts, log=logged.append)

    assert history == logged and [e.step for e in history] == list(range(NUM_STEPS))
    for entry in history:
        assert math.isfinite(entry.main_loss)
        assert len(entry.mtp_losses) == 1 and all(math.isfinite(v) and v > 0
                                                  for v in entry.mtp_losses)
        assert 0.0 <= entry.mean_reward <= 1.0
        assert entry.macro_accept_rate is not None and 0.0 <= entry.macro_accept_rate <= 1.0
        assert entry.push_s > 0
    assert [e.weight_version for e in history] == [first + i for i in range(1, NUM_STEPS + 1)]
    end = status(service)
    assert end.main_version == first + NUM_STEPS
    if sync_drafter:
        assert end.draft_version == first + NUM_STEPS
    else:
        assert end.draft_version == start.draft_version


def test_loop_config_refuses_bad_values() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        LoopConfig(service_url="http://x", checkpoint=Path("."), weights_token="t",
                   batch_size=0)
    with pytest.raises(ValueError, match="lr"):
        LoopConfig(service_url="http://x", checkpoint=Path("."), weights_token="t", lr=0.0)


def test_policy_gradient_pushes_logprob_up_for_positive_advantage() -> None:
    batch = pack_padded([Rollout(prompt_ids=[1, 2], response_ids=[3, 4], reward=1.0),
                         Rollout(prompt_ids=[1, 2], response_ids=[5, 6], reward=0.0)],
                        tp=1, cp=1, pad_id=0)
    ce = torch.ones(batch.input_ids.shape, requires_grad=True)
    policy_gradient_loss(ce, batch).backward()
    # ce = -logprob: descending the loss lowers ce (raises logprob) of the rewarded row.
    assert (ce.grad[0][batch.loss_mask[0] > 0] > 0).all()
    assert (ce.grad[1][batch.loss_mask[1] > 0] < 0).all()



def _run_20(service: ServiceProcess, *, sync_drafter: bool) -> list[StepLog]:
    cfg = LoopConfig(service_url=service.url, checkpoint=Path(ensure_model("tiny")),
                     weights_token=WEIGHTS_TOKEN, api_key=API_KEY, num_steps=20,
                     batch_size=16, max_tokens=32, lr=2e-3, sync_drafter=sync_drafter)
    return run_loop(cfg, arithmetic_prompts, log=lambda _: None)


def test_synced_drafter_stays_accepted_and_a_stale_one_does_not(
        service: ServiceProcess, restore: None) -> None:
    """The product's reason to exist, end to end on CPU: 20 RL steps from the same
    start, pushing the drafter every step vs never. Both runs begin from the
    checkpoint (the first run's weights are pushed back in between)."""
    synced = _run_20(service, sync_drafter=True)
    original = load_file(str(Path(ensure_model("tiny")) / "model.safetensors"))
    with WeightPusher(service.url, WEIGHTS_TOKEN) as pusher:
        pusher.push(original.items(), version=served_version(service) + 1, target="both")
    stale = _run_20(service, sync_drafter=False)
    assert synced[0].macro_accept_rate == pytest.approx(stale[0].macro_accept_rate, abs=0.05)
    last_synced = sum(e.macro_accept_rate for e in synced[-5:]) / 5
    last_stale = sum(e.macro_accept_rate for e in stale[-5:]) / 5
    print(f"macro accept rate, mean of the last 5 of 20 steps: synced {last_synced:.3f}, "
          f"never synced {last_stale:.3f}")
    assert last_synced > last_stale + 0.2
