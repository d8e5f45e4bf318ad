"""Multi-Token Prediction (MTP) loss that trains the MTP layers and never the shared lm_head.

Runs in the trainer process, inside the forward step, on the pipeline stage that holds
the output layer. It talks to other ranks in three places only: rolling labels
(``trainer_client.roll``) under context parallelism (boundary tokens go to the
neighbouring CP rank, through megatron-core's ``roll_tensor``), the vocabulary-parallel
cross-entropy under tensor parallelism (megatron-core's, three small all-reduces per
depth over the TP group, and one all-reduce of the hidden states' gradient in backward),
and :func:`reduce_for_logging` (one all-reduce per group, called by every rank).

The formula, as megatron-core computes it (NVIDIA/Megatron-LM,
``megatron/core/transformer/multi_token_prediction.py``: ``roll_tensor``,
``MTPLossAutoScaler``; ``process_mtp_loss`` from 0.17 on). For depth ``k = 1 .. D``::

    labels_k, mask_k = labels, loss_mask rolled left k times (vacated tail = 0)
    CE_k[b, t]  = cross_entropy(hidden_k[b, t] @ W^T + bias, labels_k[b, t])
    L_k         = sum_{b,t} mask_k[b, t] * CE_k[b, t]
    N_k         = sum_{b,t} mask_k[b, t]                     (N_0: the unrolled mask)
    scaled_k    = (lambda / D) * L_k / max(N_k, 1)           (per_token=False)
    scaled_k    = (lambda / D) * L_k * N_0 / max(N_k, 1)     (per_token=True)

``lambda`` is Megatron's ``mtp_loss_scaling_factor``. In per-token mode the trainer
divides the whole gradient by the global main-loss token count afterwards, so
multiplying by ``N_0 / N_k`` turns that division into a per-depth token mean again
("per-token-loss mode scales by N_0 / N_k instead"). ``N_0`` and ``N_k`` are counted over
the tensors this rank holds (its CP shard), as Megatron does. Note that megatron-core
0.16's own ``GPTModel`` adds ``(lambda / D) * L_k`` unnormalized in per-token mode; the
``N_0 / N_k`` rule above is what ``process_mtp_loss`` does from 0.17 on.

Gradient isolation. The logits are computed with the output layer's weight *and bias*
detached: the gradient reaches ``hidden_k`` (the MTP layers) but never the shared lm_head.
verl evaluates the output layer the same way but drops its bias; here the bias is kept.
Whether the gradient goes on from the MTP layers into the trunk (the token embedding and
the decoder's hidden states the MTP block consumes) is ``MTPLossConfig.detach_trunk``,
applied where those inputs are made: ``megatron.mtp_forward.mtp_forward(...,
detach_trunk=cfg.detach_trunk)``. With both cuts (the default) a backward of the MTP loss
alone leaves every parameter outside the MTP block at exactly zero gradient.

Tensor parallelism. With TP > 1 the output layer is split over the vocabulary: each
rank holds ``output_weight[V / tp, h]`` and computes its slice of the logits; the
cross-entropy is megatron-core's ``vocab_parallel_cross_entropy`` (every TP rank gets the
same per-token loss), and the hidden states enter through
``copy_to_tensor_model_parallel_region`` so that, as in Megatron's own output layer, their
gradient is summed over the TP ranks' vocabulary slices. Without that sum each rank's
MTP layers would get only its own slice's share of the gradient. Sequence parallelism
is not handled: gather the MTP hidden states over the sequence first.

Which Megatron path. ``GPTModel`` computes its own MTP loss whenever it gets ``labels``
(inline in 0.16, through ``process_mtp_loss`` from 0.17 on; see
:func:`megatron_has_process_mtp_loss`), with the output layer's parameters live unless
0.19's ``mtp_detach_heads`` is set. This module calls neither: it works from the MTP
hidden states, the same on every version, and is tested against a plain PyTorch
reference and against 0.16's ``GPTModel``. On 0.16 a trainer keeps Megatron's own copy
out of the gradient with ``mtp_loss_scaling_factor=0`` (its logging tracker still
records ``L_k / N_k``) and adds this loss with :func:`attach_mtp_loss`.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainer_client.mtp_autoscale import (
    attach_mtp_loss,
    get_mtp_loss_backward_scale,
    set_mtp_loss_backward_scale,
)
from trainer_client.roll import roll_left

__all__ = [
    "MTPDepthLoss",
    "MTPLossConfig",
    "attach_mtp_loss",
    "get_mtp_loss_backward_scale",
    "megatron_has_process_mtp_loss",
    "mtp_depth_losses",
    "reduce_for_logging",
    "set_mtp_loss_backward_scale",
    "total_mtp_loss",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class MTPLossConfig:
    """How the MTP loss is scaled and where its gradient may go. Checked on construction."""

    num_layers: int
    """``D``, the number of MTP layers (prediction depths); at least 1."""
    scaling_factor: float = 0.1
    """``lambda`` (Megatron's ``mtp_loss_scaling_factor``): the summed weight of all depths;
    each depth gets ``lambda / D``. Finite and >= 0."""
    per_token: bool = False
    """Megatron's ``calculate_per_token_loss``: scale depth ``k`` by ``N_0 / N_k`` (the
    trainer divides by the global token count later) instead of ``1 / N_k``."""
    detach_trunk: bool = True
    """Keep the MTP loss out of the trunk: the token embedding and the decoder's hidden
    states are detached before the MTP block (``mtp_forward(..., detach_trunk=...)`` does
    it), so the MTP loss trains the MTP layers only; the output layer is detached in any
    case (:func:`isolated_output_layer`).

    True by default because in RL the trunk is the policy: its update should be the
    policy loss's and nothing else. A drafter loss flowing into it moves the policy towards
    predicting its own samples a few tokens ahead, an objective the RL algorithm neither
    asked for nor accounts for (no importance ratio or KL term covers it), weighted by
    ``scaling_factor``, a knob meant for the drafter. slime always cuts both inputs (its CI
    checks that only MTP parameters get gradient); verl makes it a switch
    (``detach_encoder``). False is pre-training's choice (DeepSeek-V3, Megatron's own MTP
    loss): the MTP loss as an auxiliary signal that densifies the trunk's training."""

    def __post_init__(self) -> None:
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) \
                or self.num_layers < 1:
            raise ValueError(f"num_layers must be an int >= 1, got {self.num_layers!r}")
        factor = self.scaling_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) \
                or not factor >= 0 or factor == float("inf"):
            raise ValueError(f"scaling_factor must be a finite number >= 0, got {factor!r}")
        for name in ("per_token", "detach_trunk"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class MTPDepthLoss:
    """The loss of one prediction depth on this rank."""

    depth: int
    """``k``, from 1 (predicts the token after next) to ``D``."""
    loss_sum: torch.Tensor
    """``L_k``: 0-dim, masked cross-entropy sum in the loss dtype (float32, or float64
    for float64 inputs); carries the graph."""
    num_tokens: torch.Tensor
    """``N_k``: 0-dim, loss dtype, the rolled mask's sum, *not* clamped (sums stay exact
    across ranks); no graph."""
    scaled_loss: torch.Tensor
    """This depth's contribution to the trained loss (module docstring); carries the graph."""
    num_correct: torch.Tensor
    """Masked positions where the MTP head's top-1 token is the label: 0-dim, loss dtype,
    no graph. ``num_correct / num_tokens`` is the head's top-1 agreement with the tokens
    ``k + 1`` ahead, which is what a rollout engine's acceptance of its greedy drafts at
    draft position ``k - 1`` estimates on the same samples."""


def isolated_output_layer(weight: torch.Tensor, bias: torch.Tensor | None
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The shared output layer as the MTP loss sees it: weight and bias detached.

    The MTP loss must not train the lm_head the main model and the rollout drafter
    share (Megatron's stock MTP loss does); detaching both here is the one place
    that guarantees it.
    """
    return weight.detach(), None if bias is None else bias.detach()


def mtp_depth_losses(hidden_per_depth: Sequence[torch.Tensor], labels: torch.Tensor,
                     loss_mask: torch.Tensor, output_weight: torch.Tensor,
                     output_bias: torch.Tensor | None, cfg: MTPLossConfig, *,
                     hidden_layout: Literal["sbh", "bsh"] = "sbh",
                     cp_group: dist.ProcessGroup | None = None,
                     cu_seqlens: torch.Tensor | None = None,
                     tp_group: dist.ProcessGroup | None = None) -> list[MTPDepthLoss]:
    """Per-depth MTP losses, with the output layer's parameters kept out of the graph.

    Args:
        hidden_per_depth: ``D`` tensors, the output of MTP layer ``k`` (already through
            its final norm), ``[s, b, h]`` (Megatron's layout) or ``[b, s, h]``.
        labels: ``[b, s]`` int64, next-token labels (position t predicts token t + 1).
        loss_mask: ``[b, s]``, aligned with ``labels``; 0 on prompt and padding targets.
        output_weight: ``[V, h]``, the shared output layer's weight; with ``tp_group``
            of size > 1, this rank's vocabulary shard ``[V / tp, h]`` (what
            ``mtp_forward`` returns).
        output_bias: ``[V]`` (``[V / tp]`` under TP) or None; kept when given.
        cfg: Scaling and gradient options.
        hidden_layout: ``"sbh"`` or ``"bsh"``, the layout of ``hidden_per_depth``.
        cp_group: Context-parallel group when the tensors are this rank's zigzag shard
            (see :func:`roll_left`).
        cu_seqlens: Padded boundaries of a packed row (``b == 1``), see :func:`roll_left`.
        tp_group: The tensor-parallel group when the output layer is vocabulary-parallel
            (``parallel_state.get_tensor_model_parallel_group()``); every rank of it must
            call. None, or a group of size 1: the full vocabulary is local.

    Returns:
        One :class:`MTPDepthLoss` per depth, depth 1 first.

    Raises:
        ValueError: a count or shape does not match (the message names the argument).
        RuntimeError: ``tp_group`` has more than one rank and megatron-core's
            vocabulary-parallel cross-entropy is not usable with it.
    """
    num_depths = cfg.num_layers
    if len(hidden_per_depth) != num_depths:
        raise ValueError(f"hidden_per_depth has {len(hidden_per_depth)} tensors for "
                         f"num_layers = {num_depths}")
    if labels.dim() != 2 or loss_mask.shape != labels.shape:
        raise ValueError(f"labels and loss_mask must share a [b, s] shape, got "
                         f"{tuple(labels.shape)} and {tuple(loss_mask.shape)}")
    if hidden_layout not in ("sbh", "bsh"):
        raise ValueError(f"hidden_layout must be 'sbh' or 'bsh', got {hidden_layout!r}")
    if output_weight.dim() != 2:
        raise ValueError(f"output_weight must be [V, h], got {tuple(output_weight.shape)}")
    vocab, hidden_size = output_weight.shape
    if output_bias is not None and tuple(output_bias.shape) != (vocab,):
        raise ValueError(f"output_bias must be [{vocab}], got {tuple(output_bias.shape)}")
    batch, seq = labels.shape
    expected = (seq, batch, hidden_size) if hidden_layout == "sbh" else (batch, seq, hidden_size)
    for k, hidden in enumerate(hidden_per_depth, start=1):
        if tuple(hidden.shape) != expected:
            raise ValueError(f"hidden_per_depth[{k - 1}] has shape {tuple(hidden.shape)}, "
                             f"expected {expected} ({hidden_layout})")

    is_vocab_parallel = tp_group is not None and dist.get_world_size(tp_group) > 1
    cross_entropy = _vocab_parallel_ce(tp_group) if is_vocab_parallel else _local_ce
    weight, bias = isolated_output_layer(output_weight, output_bias)
    depth_scale = cfg.scaling_factor / num_depths
    rolled_labels, rolled_mask = labels, loss_mask.detach()
    losses = []
    for k, hidden in enumerate(hidden_per_depth, start=1):
        # Roll one step per depth: under CP every shift is one boundary exchange.
        rolled_labels = roll_left(rolled_labels, 1, -1, cp_group=cp_group, cu_seqlens=cu_seqlens)
        rolled_mask = roll_left(rolled_mask, 1, -1, cp_group=cp_group, cu_seqlens=cu_seqlens)
        hidden_bsh = hidden.transpose(0, 1) if hidden_layout == "sbh" else hidden
        if is_vocab_parallel:
            hidden_bsh = _copy_to_tp_region(hidden_bsh, tp_group)
        logits = F.linear(hidden_bsh, weight, bias)
        # Cross-entropy in at least float32 (bf16 logits lose the small differences).
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        per_token_ce = cross_entropy(logits, rolled_labels)
        mask = rolled_mask.to(logits.dtype)
        loss_sum = (mask * per_token_ce).sum()
        with torch.no_grad():
            top1 = _top1_vocab_parallel(logits, tp_group) if is_vocab_parallel \
                else logits.argmax(dim=-1)
            num_correct = (mask * (top1 == rolled_labels).to(mask.dtype)).sum()
        num_tokens = mask.sum()
        if cfg.per_token:
            num_tokens_main = loss_mask.detach().to(mask.dtype).sum()
            scaled = depth_scale * loss_sum * num_tokens_main / num_tokens.clamp(min=1.0)
        else:
            scaled = depth_scale * loss_sum / num_tokens.clamp(min=1.0)
        losses.append(MTPDepthLoss(depth=k, loss_sum=loss_sum, num_tokens=num_tokens,
                                   scaled_loss=scaled, num_correct=num_correct))
    return losses


def _top1_vocab_parallel(logits: torch.Tensor, tp_group: dist.ProcessGroup) -> torch.Tensor:
    """Global vocabulary index of the top logit, from each TP rank's vocabulary shard: two
    all-reduces over ``tp_group`` (the maximum, then the smallest index holding it, so
    ties break as ``argmax`` does on the full vocabulary)."""
    local_max, local_index = logits.max(dim=-1)
    offset = dist.get_rank(tp_group) * logits.size(-1)
    global_max = local_max.clone()
    dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=tp_group)
    no_index = torch.iinfo(torch.int64).max
    index = torch.where(local_max == global_max, local_index + offset,
                        torch.full_like(local_index, no_index))
    dist.all_reduce(index, op=dist.ReduceOp.MIN, group=tp_group)
    return index


def _local_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy ``[b, s]`` over a full local vocabulary."""
    return F.cross_entropy(logits.flatten(0, -2), labels.reshape(-1),
                           reduction="none").view(labels.shape)


def _vocab_parallel_ce(tp_group: dist.ProcessGroup) -> Any:
    """megatron-core's vocabulary-parallel cross-entropy bound to ``tp_group``.

    0.19 takes the group as an argument; 0.16 always uses parallel_state's TP group,
    so there the given group must be that one."""
    try:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    except ImportError as exc:
        raise RuntimeError("mtp_depth_losses with a TP group of size > 1 needs megatron-core's "
                           "vocab_parallel_cross_entropy (pip install megatron-core)") from exc
    if "tp_group" in inspect.signature(vocab_parallel_cross_entropy).parameters:
        return lambda logits, labels: vocab_parallel_cross_entropy(logits, labels,
                                                                   tp_group=tp_group)
    if tp_group is not parallel_state.get_tensor_model_parallel_group():
        raise RuntimeError("tp_group: this megatron-core's vocab_parallel_cross_entropy always "
                           "uses parallel_state's TP group; pass that group")
    return vocab_parallel_cross_entropy


def _copy_to_tp_region(hidden: torch.Tensor, tp_group: dist.ProcessGroup) -> torch.Tensor:
    """Identity forward, gradient all-reduced over ``tp_group`` (Megatron's own mapping)."""
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

    return copy_to_tensor_model_parallel_region(hidden, group=tp_group)


def total_mtp_loss(losses: Sequence[MTPDepthLoss]) -> torch.Tensor:
    """``sum_k scaled_k``: what :func:`attach_mtp_loss` hangs on the main output."""
    if not losses:
        raise ValueError("losses is empty")
    return torch.stack([loss.scaled_loss for loss in losses]).sum()


def reduce_for_logging(losses: Sequence[MTPDepthLoss], *,
                       groups: Sequence[dist.ProcessGroup | None],
                       is_source_rank: bool) -> dict[str, float] | None:
    """Global per-depth MTP loss for the logs: sums over ranks, then one division.

    Every rank of every group must call this, the same number of times, with the same
    number of depths: each group costs one ``all_reduce`` of ``3 * D`` numbers, and a
    collective that some ranks skip waits forever. verl gated this reduce on
    ``cp_rank == 0`` and deadlocked with CP > 1 (verl #5895). Only the *return* is gated
    here: the source rank gets the dict, the others None.

    Args:
        losses: This rank's depths, from :func:`mtp_depth_losses`.
        groups: Groups whose ranks hold disjoint tokens, reduced one after the other: the
            DP x CP group, and the TP group only when TP ranks hold different tokens (the
            usual vocab-parallel loss is already identical on TP ranks; summing it there
            would multiply the token counts by TP). None means the default group. Empty
            when not distributed.
        is_source_rank: Whether this rank returns the dict (e.g. the logging rank).

    Returns:
        On the source rank ``{"mtp_{k}_loss": sum L_k / max(sum N_k, 1),
        "mtp_{k}_num_tokens": sum N_k, "mtp_{k}_accuracy": sum correct_k / max(sum N_k,
        1)}`` for every depth (accuracy: the head's top-1 agreement); elsewhere None.

    Raises:
        ValueError: ``losses`` is empty, or ``groups`` is non-empty without an initialized
            default process group.
    """
    if not losses:
        raise ValueError("losses is empty")
    if groups and not (dist.is_available() and dist.is_initialized()):
        raise ValueError("groups given but torch.distributed is not initialized")
    values = torch.stack([loss.loss_sum.detach() for loss in losses]
                         + [loss.num_tokens.detach() for loss in losses]
                         + [loss.num_correct.detach() for loss in losses]).to(torch.float64)
    for group in groups:
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=group)
    if not is_source_rank:
        return None
    num_depths = len(losses)
    result = {}
    for i, loss in enumerate(losses):
        loss_sum, num_tokens = float(values[i]), float(values[num_depths + i])
        result[f"mtp_{loss.depth}_loss"] = loss_sum / max(num_tokens, 1.0)
        result[f"mtp_{loss.depth}_num_tokens"] = num_tokens
        result[f"mtp_{loss.depth}_accuracy"] = \
            float(values[2 * num_depths + i]) / max(num_tokens, 1.0)
    return result


def megatron_has_process_mtp_loss() -> bool:
    """Whether the installed megatron-core has ``process_mtp_loss`` (0.17+), found by feature.

    With it, ``GPTModel`` computes its MTP loss through that function (signature grew
    ``tp_group`` and ``input_ids`` by 0.19); without it (0.16) inline in
    ``GPTModel._postprocess``. Either way this module's loss is computed outside the
    model from the MTP hidden states; the answer tells a trainer which of Megatron's own
    paths it has to keep out of the gradient. False when megatron-core is not installed.
    """
    try:
        from megatron.core.transformer import multi_token_prediction
    except ImportError:
        return False
    return callable(getattr(multi_token_prediction, "process_mtp_loss", None))
