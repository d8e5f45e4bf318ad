"""The RL loop: generate -> pack -> train (policy + MTP loss) -> push, once per step.

Runs in the trainer process (one CPU rank: megatron-core's ``GPTModel`` in fp32 over
gloo, see ``megatron.model.init_parallel_cpu``). Talks to one rollout service over
HTTP: rollouts through ``RolloutClient.generate_batch`` (generation API key), weights
through ``WeightPusher`` (shared memory plus JSON control calls, weights token).

Prompts come from a :data:`~trainer_client.task.PromptSource`; the reward is
:func:`~trainer_client.task.reward` (toy, verifiable, shaped), which moves the
policy within a few steps. That moving policy is what the demo needs: a drafter
that is never synced keeps predicting the old policy.

Policy loss (pluggable, :data:`PolicyLoss`): plain policy gradient,
``-(advantage * logprob)`` over the response tokens, advantage = reward - batch mean.
Megatron's per-token cross-entropy is ``-logprob`` of the label, so the default is
``mean(advantage * ce)``. The MTP loss (``mtp_loss.mtp_depth_losses``) rides on the
same backward through ``attach_mtp_loss``: the drafter learns the current policy's
samples. ``MTPLossConfig``'s default ``detach_trunk`` keeps that loss in the MTP layers:
the policy's weights move by the policy loss alone.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rollout_service.client import RolloutClient
from rollout_service.protocol import messages
from trainer_client.batch import PaddedBatch, Rollout, pack_padded
from trainer_client.push import PushReport, WeightPusher
from trainer_client.task import PromptSource, category_of, reward

__all__ = ["LoopConfig", "PolicyLoss", "StepLog", "policy_gradient_loss", "run_loop"]

PolicyLoss = Callable[[torch.Tensor, PaddedBatch], torch.Tensor]
"""``(per-token cross-entropy [b, s] = -logprob of labels, batch) -> scalar loss``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LoopConfig:
    """One RL run against one rollout service."""

    service_url: str
    """The rollout service, e.g. ``http://127.0.0.1:8000``."""
    checkpoint: Path
    """Directory of the checkpoint the service serves (config.json, model.safetensors):
    the trainer starts from the same weights."""
    weights_token: str
    """The service's weights token (for pushes)."""
    api_key: str | None = None
    """The service's generation API key; None when generation is open."""
    num_steps: int = 20
    """Optimizer steps (one generate / train / push each)."""
    batch_size: int = 16
    """Prompts per step (one sample each)."""
    max_tokens: int = 32
    """Tokens generated per sample at most."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts."""
    lr: float = 2e-3
    """Adam learning rate."""
    mtp_scaling_factor: float = 1.0
    """Weight of the MTP loss (summed over depths)."""
    sync_drafter: bool = True
    """Push to ``both`` (main and drafter) when True, to ``main`` only when False."""
    seed: int = 0
    """Seeds torch and the prompt choice."""

    def __post_init__(self) -> None:
        for name in ("num_steps", "batch_size", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr: must be a positive number, got {self.lr}")
        if not (self.mtp_scaling_factor >= 0 and math.isfinite(self.mtp_scaling_factor)):
            raise ValueError(f"mtp_scaling_factor: must be >= 0, got {self.mtp_scaling_factor}")


@dataclass(frozen=True, kw_only=True, slots=True)
class StepLog:
    """What one step did; ``macro_accept_rate`` is the rollout of this step, served with
    the weights of the previous step's push."""

    step: int
    main_loss: float
    """The policy loss."""
    mtp_losses: list[float]
    """Per-depth MTP cross-entropy (unscaled), depth 1 first."""
    mtp_accuracy: list[float]
    """Per-depth top-1 agreement of the MTP head with the response tokens depth + 1 ahead,
    measured with the weights that generated the batch; sent with the push."""
    mean_reward: float
    weight_version: int
    """The version pushed at the end of the step."""
    push_s: float
    macro_accept_rate: float | None
    """Service's mean per-sequence accept rate for this step's batch."""
    macro_accept_rate_by_category: dict[str, float | None]
    """The same per category the prompts named (empty without categories)."""
    step_s: float
    """Wall time of the whole step."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Losses:
    policy: float
    mtp: list[float]
    mtp_accuracy: list[float]
    num_tokens: int
    """Response tokens the depth-1 figures count."""


def policy_gradient_loss(per_token_ce: torch.Tensor, batch: PaddedBatch) -> torch.Tensor:
    """REINFORCE: mean over response tokens of ``advantage * ce`` (= ``-adv * logprob``)."""
    advantage = batch.rewards - batch.rewards.mean()
    mask = batch.loss_mask
    return (advantage[:, None] * per_token_ce * mask).sum() / mask.sum().clamp(min=1.0)


# --------------------------------------------------------------------------- the loop

def run_loop(cfg: LoopConfig, prompts: PromptSource, *, log: Callable[[StepLog], None],
             policy_loss: PolicyLoss = policy_gradient_loss) -> list[StepLog]:
    """Runs ``cfg.num_steps`` steps; calls ``log`` after each and returns all logs.

    Raises:
        ServiceError: the service refused a generation request or a push (e.g. a
            stale version); a refused push changed nothing on the service.
    """
    hf_config = json.loads((cfg.checkpoint / "config.json").read_text(encoding="utf-8"))
    target = "both" if cfg.sync_drafter else "main"
    history = []
    with trainer(cfg, hf_config) as (model, optimizer), \
            WeightPusher(cfg.service_url, cfg.weights_token) as pusher:
        version = asyncio.run(served_version(cfg))
        for step in range(cfg.num_steps):
            start = time.perf_counter()
            batch_prompts = prompts(cfg.batch_size, cfg.seed * 100_003 + step)
            response = asyncio.run(generate(cfg, [item[0] for item in batch_prompts], step=step,
                                            categories=[category_of(i) for i in batch_prompts]))
            rollouts = to_rollouts(response, [item[1] for item in batch_prompts])
            batch = pack_padded(rollouts, tp=1, cp=1, pad_id=int(hf_config["eos_token_id"]))
            losses = train_step(model, optimizer, batch, hf_config, cfg, policy_loss)
            # The forward ran with the weights that generated the batch: the served version.
            stats = messages.TrainingStats(version=version, mtp_accuracy=losses.mtp_accuracy,
                                           num_tokens=losses.num_tokens)
            version += 1
            report = push(pusher, model, hf_config, version=version, target=target,
                          training_stats=stats)
            assert report is not None  # this process holds the pusher
            entry = StepLog(step=step, main_loss=losses.policy, mtp_losses=losses.mtp,
                            mtp_accuracy=losses.mtp_accuracy,
                            mean_reward=float(batch.rewards.mean()), weight_version=version,
                            push_s=report.total_s,
                            macro_accept_rate=response.acceptance.macro_accept_rate,
                            macro_accept_rate_by_category={
                                name: summary.macro_accept_rate
                                for name, summary in response.acceptance_by_category.items()},
                            step_s=time.perf_counter() - start)
            log(entry)
            history.append(entry)
    return history


# --------------------------------------------------------------------------- steps

@contextmanager
def trainer(cfg: LoopConfig, hf_config: dict[str, Any]
            ) -> Iterator[tuple[torch.nn.Module, torch.optim.Optimizer]]:
    """The served checkpoint as an fp32 ``GPTModel`` (CPU, TP 1) and its Adam."""
    from safetensors.torch import load_file

    from trainer_client.megatron.convert import load_hf_state
    from trainer_client.megatron.model import build_gpt_mtp_model, init_parallel_cpu
    from trainer_client.mtp_loss import set_mtp_loss_backward_scale

    with init_parallel_cpu(seed=cfg.seed):
        model = build_gpt_mtp_model(hf_config)
        load_hf_state(model, load_file(str(cfg.checkpoint / "model.safetensors")), hf_config)
        model.train()
        set_mtp_loss_backward_scale(1.0)
        yield model, torch.optim.Adam(model.parameters(), lr=cfg.lr)


async def served_version(cfg: LoopConfig) -> int:
    """The newest weight version the service serves (0 before any push)."""
    async with RolloutClient(cfg.service_url, weights_token=cfg.weights_token) as client:
        return (await client.weight_status()).newest_version


async def generate(cfg: LoopConfig, prompts: Sequence[str], *, step: int,
                   categories: Sequence[str | None] | None = None
                   ) -> messages.BatchGenerateResponse:
    """One sample per prompt (of its category, if given), with its per-token
    log-probabilities.

    Each request is seeded from (seed, step, index): two runs from the same weights
    draw the same first batch.
    """
    first_seed = (cfg.seed * 1_000_003 + step) * cfg.batch_size
    categories = categories or [None] * len(prompts)
    requests = [messages.GenerateRequest(prompt=prompt, max_tokens=cfg.max_tokens,
                                         temperature=cfg.temperature, logprobs=True,
                                         seed=first_seed + i, category=category)
                for i, (prompt, category) in enumerate(zip(prompts, categories, strict=True))]
    async with RolloutClient(cfg.service_url, api_key=cfg.api_key) as client:
        return await client.generate_batch(messages.BatchGenerateRequest(requests=requests))


def to_rollouts(response: messages.BatchGenerateResponse, answers: Sequence[str]) -> list[Rollout]:
    """One ``Rollout`` per response, rewarded with :func:`reward`.

    A sample that stopped before its first token gets no Rollout (nothing to train).
    """
    rollouts = []
    for item, answer in zip(response.responses, answers, strict=True):
        out = item.outputs[0]
        if out.token_ids:
            rollouts.append(Rollout(prompt_ids=item.prompt_token_ids,
                                    response_ids=out.token_ids,
                                    reward=reward(out.text, answer),
                                    old_logprobs=out.logprobs))
    if not rollouts:
        raise RuntimeError("every sample of the batch is empty")
    return rollouts


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: PaddedBatch,
               hf_config: dict[str, Any], cfg: LoopConfig,
               policy_loss: PolicyLoss) -> Losses:
    """One forward (main + MTP), one backward of policy loss + MTP loss, one Adam step."""
    from trainer_client.megatron.mtp_forward import mtp_forward
    from trainer_client.mtp_loss import (
        MTPLossConfig,
        attach_mtp_loss,
        mtp_depth_losses,
        reduce_for_logging,
        total_mtp_loss,
    )

    mtp_cfg = MTPLossConfig(num_layers=int(hf_config["num_nextn_predict_layers"]),
                            scaling_factor=cfg.mtp_scaling_factor)
    seq = batch.input_ids.size(1)
    causal = torch.ones(seq, seq, dtype=torch.bool).triu(1).view(1, 1, seq, seq)
    out = mtp_forward(model, batch.input_ids, batch.position_ids, causal, batch.labels,
                      batch.loss_mask, detach_trunk=mtp_cfg.detach_trunk)
    depth_losses = mtp_depth_losses(out.mtp_hidden, batch.labels, batch.loss_mask,
                                    out.output_weight, None, mtp_cfg)
    per_token_ce = attach_mtp_loss(out.main_output, total_mtp_loss(depth_losses))
    loss = policy_loss(per_token_ce, batch)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    logged = reduce_for_logging(depth_losses, groups=[], is_source_rank=True)
    assert logged is not None
    depths = range(1, mtp_cfg.num_layers + 1)
    return Losses(policy=float(loss.detach()), mtp=[logged[f"mtp_{k}_loss"] for k in depths],
                  mtp_accuracy=[logged[f"mtp_{k}_accuracy"] for k in depths],
                  num_tokens=int(logged["mtp_1_num_tokens"]))


def push(pusher: WeightPusher | None, model: torch.nn.Module, hf_config: dict[str, Any], *,
         version: int, target: messages.PushTarget,
         tp_group: torch.distributed.ProcessGroup | None = None,
         training_stats: messages.TrainingStats | None = None) -> PushReport | None:
    """The trained weights, under checkpoint names and dtype, into the service.

    Every rank of ``tp_group`` calls: each tensor is one all-gather. The rank holding
    the pusher (TP rank 0 by convention) sends; the others pass None and get None. The
    names, shapes and dtype are announced before the gather streams, so no rank holds
    the whole model twice. When the service refuses the push, or the pusher fails,
    the rest of the export is still drained, so the other TP ranks never wait in an
    all-gather that rank 0 left (the error is raised after).
    """
    from trainer_client.megatron.convert import export_dtype, export_hf_weights, hf_tensor_shapes

    exported = export_hf_weights(model, hf_config, tp_group)
    try:
        if pusher is None:
            return None
        tp_size = 1 if tp_group is None else torch.distributed.get_world_size(tp_group)
        dtype = str(export_dtype(model, hf_config)).removeprefix("torch.")
        specs = [messages.ParamSpec(name=name, shape=list(shape), dtype=dtype)
                 for name, shape in hf_tensor_shapes(model, hf_config, tp_size).items()]
        return pusher.push(exported, version=version, target=target, specs=specs,
                           training_stats=training_stats)
    finally:
        for _ in exported:
            pass
