"""Turn rollouts into Megatron-ready token batches: padded (BSHD) or packed (THD).

Runs in the trainer process, between the rollout client (which returns token ids)
and the Megatron forward step; pure torch, no Megatron import, no communication.

Label convention (Megatron's, the one its MTP loss rolls): position ``t`` predicts
the *next* token,

    labels[t]    = input_ids[t + 1]            (pad_id at the last position)
    loss_mask[t] = 1  iff  token t + 1 is a trained response token

so ``loss_mask`` is aligned with ``labels``, not with ``input_ids``. Each input is
``[prompt; response]``: the mask is 0 wherever the target is a prompt token or
padding, and the rollout's ``response_mask`` wherever the target is a response
token (multi-turn tool outputs carry 0 there). The last real position of every
sequence has mask 0: its target would be padding or, in a packed row, the next
sequence. ``old_logprobs`` (when given) follow the same alignment: the value at
``t`` is the old log-probability of ``labels[t]``.

Lengths are padded so that the batch can be zigzag-split over CP ranks and scattered
over TP ranks: a padded row to :func:`trainer_client.padding.padded_length`; in a packed
row each sequence to ``2 * cp`` and the row's total to the padded row's multiple
(:func:`trainer_client.padding.packed_padded_lengths`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trainer_client.padding import packed_padded_lengths, padded_length

__all__ = ["PackedBatch", "PaddedBatch", "Rollout", "pack_padded", "pack_thd"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Rollout:
    """One generated sample, as token ids. Checked on construction."""

    prompt_ids: list[int]
    """Prompt tokens (never trained on); at least one."""
    response_ids: list[int]
    """Generated tokens, tool outputs of a multi-turn episode included; at least one."""
    response_mask: list[int] | None = None
    """Per response token: 1 = trained, 0 = not (e.g. tool output). None = all ones."""
    reward: float = 0.0
    """Scalar reward of the whole sample."""
    old_logprobs: list[float] | None = None
    """Per response token: the rollout policy's log-probability of it, if recorded."""

    def __post_init__(self) -> None:
        for name in ("prompt_ids", "response_ids"):
            ids = getattr(self, name)
            if len(ids) == 0:
                raise ValueError(f"{name} is empty")
            for i, token in enumerate(ids):
                if isinstance(token, bool) or not isinstance(token, int):
                    raise ValueError(f"{name}[{i}] must be an int token id, got {token!r}")
                if token < 0:
                    raise ValueError(f"{name}[{i}] is a negative token id: {token}")
        num_response = len(self.response_ids)
        if self.response_mask is not None:
            if len(self.response_mask) != num_response:
                raise ValueError(f"response_mask has {len(self.response_mask)} entries for "
                                 f"{num_response} response_ids")
            for i, value in enumerate(self.response_mask):
                if isinstance(value, bool) or not isinstance(value, int) or value not in (0, 1):
                    raise ValueError(f"response_mask[{i}] must be 0 or 1, got {value!r}")
        if isinstance(self.reward, bool) or not isinstance(self.reward, (int, float)) \
                or not math.isfinite(self.reward):
            raise ValueError(f"reward must be a finite number, got {self.reward!r}")
        if self.old_logprobs is not None and len(self.old_logprobs) != num_response:
            raise ValueError(f"old_logprobs has {len(self.old_logprobs)} entries for "
                             f"{num_response} response_ids")

    @property
    def num_tokens(self) -> int:
        """Prompt plus response length."""
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass(frozen=True, kw_only=True, slots=True)
class PaddedBatch:
    """``B`` sequences, one per row, right-padded to a common length ``S`` (BSHD)."""

    input_ids: torch.Tensor
    """``[B, S]`` int64; ``pad_id`` past each sequence's end."""
    attention_mask: torch.Tensor
    """``[B, S]`` bool, True on real tokens (Hugging Face meaning). Megatron's own
    ``attention_mask`` argument means the opposite (True = masked out)."""
    position_ids: torch.Tensor
    """``[B, S]`` int64, ``0 .. S-1`` in every row (padding positions are masked)."""
    labels: torch.Tensor
    """``[B, S]`` int64, ``input_ids`` shifted left by one; ``pad_id`` in the last column."""
    loss_mask: torch.Tensor
    """``[B, S]`` float32, 1 where ``labels[t]`` is a trained response token."""
    response_start: torch.Tensor
    """``[B]`` int64, index of the first response token in ``input_ids`` (= prompt
    length); the first position that can carry loss is one earlier."""
    seq_lengths: torch.Tensor
    """``[B]`` int64, real (unpadded) lengths."""
    rewards: torch.Tensor
    """``[B]`` float32."""
    old_logprobs: torch.Tensor | None
    """``[B, S]`` float32 aligned with ``labels`` (0 where the mask is 0), or None
    when the rollouts carry none."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PackedBatch:
    """``B`` sequences in one row, each padded on its own (THD)."""

    input_ids: torch.Tensor
    """``[1, T]`` int64, ``T = cu_seqlens_padded[-1]``."""
    position_ids: torch.Tensor
    """``[1, T]`` int64, restarting at 0 at each sequence's start."""
    labels: torch.Tensor
    """``[1, T]`` int64, next token within the same sequence; ``pad_id`` at each
    sequence's last real position and over its padding."""
    loss_mask: torch.Tensor
    """``[1, T]`` float32, 1 where ``labels[t]`` is a trained response token."""
    cu_seqlens: torch.Tensor
    """``[B + 1]`` int32 cumulative *real* lengths, starting at 0 (attention bounds)."""
    cu_seqlens_padded: torch.Tensor
    """``[B + 1]`` int32 cumulative *padded* lengths, starting at 0 (where each
    sequence starts in the row); the last span also holds the row's own padding."""
    response_start: torch.Tensor
    """``[B]`` int64, prompt length: offset of the first response token from the
    sequence's start ``cu_seqlens_padded[i]``."""
    seq_lengths: torch.Tensor
    """``[B]`` int64, real (unpadded) lengths."""
    rewards: torch.Tensor
    """``[B]`` float32."""
    old_logprobs: torch.Tensor | None
    """``[1, T]`` float32 aligned with ``labels``, or None when the rollouts carry none."""


def _check_batch(rollouts: Sequence[Rollout], pad_id: int) -> bool:
    """Refuse an empty batch, a bad pad id and mixed old_logprobs; return whether any exist."""
    if len(rollouts) == 0:
        raise ValueError("rollouts is empty")
    if isinstance(pad_id, bool) or not isinstance(pad_id, int) or pad_id < 0:
        raise ValueError(f"pad_id must be a non-negative int, got {pad_id!r}")
    num_with_logprobs = sum(r.old_logprobs is not None for r in rollouts)
    if 0 < num_with_logprobs < len(rollouts):
        raise ValueError(f"old_logprobs given for {num_with_logprobs} of {len(rollouts)} "
                         "rollouts: give them for all or none")
    return num_with_logprobs > 0


def _fill_sequence(rollout: Rollout, pad_id: int, input_ids: torch.Tensor, labels: torch.Tensor,
                   loss_mask: torch.Tensor, old_logprobs: torch.Tensor | None) -> None:
    """Write one rollout into 1-D views that are already ``pad_id`` / 0 filled."""
    num_prompt, length = len(rollout.prompt_ids), rollout.num_tokens
    tokens = torch.tensor(rollout.prompt_ids + rollout.response_ids, dtype=torch.int64)
    input_ids[:length] = tokens
    # labels[length - 1] stays pad_id: the sequence ends there.
    labels[:length - 1] = tokens[1:]
    # Position t predicts token t + 1: response token i is the target at num_prompt - 1 + i.
    targets = slice(num_prompt - 1, length - 1)
    if rollout.response_mask is None:
        loss_mask[targets] = 1.0
    else:
        loss_mask[targets] = torch.tensor(rollout.response_mask, dtype=torch.float32)
    if old_logprobs is not None:
        old_logprobs[targets] = torch.tensor(rollout.old_logprobs, dtype=torch.float32)
        old_logprobs[targets] *= loss_mask[targets]


def pack_padded(rollouts: Sequence[Rollout], tp: int, cp: int, pad_id: int, *,
                extra_multiple: int = 1) -> PaddedBatch:
    """One row per rollout, right-padded to ``padded_length(max length, tp, cp)``.

    Args:
        rollouts: The samples, in batch order.
        tp: Tensor-parallel size (sequence parallelism).
        cp: Context-parallel size (zigzag).
        pad_id: Token id written into padding and into labels without a target.
        extra_multiple: A further multiple of the row length (``padding`` module
            docstring: a global multiple, not a per-rank rule).

    Returns:
        The batch; see the module docstring for the label / loss-mask convention.

    Raises:
        ValueError: ``rollouts`` is empty, ``pad_id`` is negative, only some rollouts
            have ``old_logprobs``, or tp / cp / extra_multiple is invalid.
    """
    has_logprobs = _check_batch(rollouts, pad_id)
    lengths = [r.num_tokens for r in rollouts]
    num_seqs, seq_len = len(rollouts), padded_length(max(lengths), tp, cp, extra_multiple)
    input_ids = torch.full((num_seqs, seq_len), pad_id, dtype=torch.int64)
    labels = torch.full((num_seqs, seq_len), pad_id, dtype=torch.int64)
    loss_mask = torch.zeros((num_seqs, seq_len), dtype=torch.float32)
    old_logprobs = torch.zeros((num_seqs, seq_len), dtype=torch.float32) if has_logprobs else None
    for b, rollout in enumerate(rollouts):
        _fill_sequence(rollout, pad_id, input_ids[b], labels[b], loss_mask[b],
                       None if old_logprobs is None else old_logprobs[b])
    seq_lengths = torch.tensor(lengths, dtype=torch.int64)
    return PaddedBatch(
        input_ids=input_ids,
        attention_mask=torch.arange(seq_len).unsqueeze(0) < seq_lengths.unsqueeze(1),
        position_ids=torch.arange(seq_len, dtype=torch.int64).expand(num_seqs, -1).contiguous(),
        labels=labels,
        loss_mask=loss_mask,
        response_start=torch.tensor([len(r.prompt_ids) for r in rollouts], dtype=torch.int64),
        seq_lengths=seq_lengths,
        rewards=torch.tensor([float(r.reward) for r in rollouts], dtype=torch.float32),
        old_logprobs=old_logprobs,
    )


def pack_thd(rollouts: Sequence[Rollout], tp: int, cp: int, pad_id: int, *,
             extra_multiple: int = 1) -> PackedBatch:
    """All rollouts in one row, padded by ``padding.packed_padded_lengths``.

    Each sequence is padded to a multiple of ``2 * cp`` (what lets
    ``padding.zigzag_split_packed`` split every sequence over the CP ranks); the row's
    total to ``padding.pad_multiple(tp, cp)`` (what sequence parallelism needs of each CP
    rank's share), by extending the last sequence's padding.

    Args:
        rollouts: The samples, in packing order.
        tp: Tensor-parallel size (sequence parallelism).
        cp: Context-parallel size (zigzag).
        pad_id: Token id written into padding and into labels without a target.
        extra_multiple: A further multiple of the row's total (``padding`` module
            docstring: a global multiple, not a per-rank rule).

    Returns:
        The packed batch; no label crosses a sequence boundary.

    Raises:
        ValueError: as :func:`pack_padded`.
    """
    has_logprobs = _check_batch(rollouts, pad_id)
    lengths = [r.num_tokens for r in rollouts]
    padded = packed_padded_lengths(lengths, tp, cp, extra_multiple)
    cu_seqlens = torch.zeros(len(rollouts) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.tensor(lengths).cumsum(0)
    cu_seqlens_padded = torch.zeros(len(rollouts) + 1, dtype=torch.int32)
    cu_seqlens_padded[1:] = torch.tensor(padded).cumsum(0)
    total = int(cu_seqlens_padded[-1])
    input_ids = torch.full((1, total), pad_id, dtype=torch.int64)
    labels = torch.full((1, total), pad_id, dtype=torch.int64)
    loss_mask = torch.zeros((1, total), dtype=torch.float32)
    old_logprobs = torch.zeros((1, total), dtype=torch.float32) if has_logprobs else None
    position_ids = torch.empty((1, total), dtype=torch.int64)
    for i, rollout in enumerate(rollouts):
        span = slice(int(cu_seqlens_padded[i]), int(cu_seqlens_padded[i + 1]))
        _fill_sequence(rollout, pad_id, input_ids[0, span], labels[0, span], loss_mask[0, span],
                       None if old_logprobs is None else old_logprobs[0, span])
        position_ids[0, span] = torch.arange(padded[i])
    return PackedBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        labels=labels,
        loss_mask=loss_mask,
        cu_seqlens=cu_seqlens,
        cu_seqlens_padded=cu_seqlens_padded,
        response_start=torch.tensor([len(r.prompt_ids) for r in rollouts], dtype=torch.int64),
        seq_lengths=torch.tensor(lengths, dtype=torch.int64),
        rewards=torch.tensor([float(r.reward) for r in rollouts], dtype=torch.float32),
        old_logprobs=old_logprobs,
    )
