"""Shift labels and loss masks left by k tokens: the targets of MTP depth k.

Runs in each trainer rank, inside the MTP loss. A shift never wraps the head of
a sequence onto its tail (``torch.roll`` would make the last positions targets)
and never crosses from one packed sequence into the next. Under context
parallelism a rank holds two zigzag chunks of every sequence, so a token shifted
off a chunk's head may come from another rank: that case goes through
megatron-core's ``roll_tensor`` (NVIDIA/Megatron-LM,
``megatron/core/transformer/multi_token_prediction.py``), one exchange per shift.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["roll_left"]


def roll_left(t: torch.Tensor, shifts: int = 1, dim: int = -1, *,
              cp_group: dist.ProcessGroup | None = None,
              cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Shift ``t`` left by ``shifts`` along ``dim`` and zero the vacated tail.

    ``torch.roll`` would wrap the head around to the tail; a rolled loss mask would then
    mark the last positions as targets. Here they are 0.

    Args:
        t: Any tensor; ``dim`` is its sequence dim.
        shifts: How far, >= 0.
        dim: The sequence dim.
        cp_group: The context-parallel group when ``t`` is this rank's zigzag shard
            (chunks ``r`` and ``2cp-1-r``). Then a token shifted off a chunk's head comes
            from the next chunk, possibly on another rank: the roll is delegated to
            megatron-core's ``roll_tensor`` (one exchange per shift). Every rank of the
            group must call. None, or a group of size 1: a local roll.
        cu_seqlens: For a packed (THD) row, the padded sequence boundaries
            ``[num_seqs + 1]`` of the *whole* row (before any CP split; Megatron's
            convention): each sequence is rolled alone, so no sequence's token becomes
            another's target. Only with ``dim`` the last dim.

    Returns:
        A new tensor, same shape, dtype and device.

    Raises:
        ValueError: ``shifts`` is negative, or ``cu_seqlens`` does not fit ``t``.
        RuntimeError: ``cp_group`` has more than one rank and megatron-core's
            ``roll_tensor`` (with ``cp_group`` / ``packed_seq_params``) is not available.
    """
    if isinstance(shifts, bool) or not isinstance(shifts, int) or shifts < 0:
        raise ValueError(f"shifts must be an int >= 0, got {shifts!r}")
    if shifts == 0:
        return t.clone()
    dim = dim % t.dim()
    if cu_seqlens is not None and dim != t.dim() - 1:
        raise ValueError(f"cu_seqlens needs the sequence in the last dim, got dim={dim}")
    if cp_group is not None and dist.get_world_size(cp_group) > 1:
        out = t
        for _ in range(shifts):
            out = _megatron_roll_once(out, dim, cp_group, cu_seqlens)
        return out
    if cu_seqlens is not None:
        return _roll_packed(t, shifts, cu_seqlens)
    length = t.size(dim)
    if shifts >= length:
        return torch.zeros_like(t)
    tail_shape = list(t.shape)
    tail_shape[dim] = shifts
    return torch.cat([t.narrow(dim, shifts, length - shifts), t.new_zeros(tail_shape)], dim=dim)


def _roll_packed(t: torch.Tensor, shifts: int, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Roll each sequence of a packed last dim on its own (no CP)."""
    bounds = cu_seqlens.to(device=t.device, dtype=torch.int64)
    length = t.size(-1)
    if bounds.dim() != 1 or bounds.numel() < 2 or int(bounds[0]) != 0 \
            or int(bounds[-1]) != length or bool((bounds[1:] < bounds[:-1]).any()):
        raise ValueError(f"cu_seqlens must rise from 0 to t.size(-1) = {length}, "
                         f"got {cu_seqlens.tolist()}")
    positions = torch.arange(length, device=t.device)
    # End of the sequence each position belongs to.
    seq_end = bounds[torch.searchsorted(bounds, positions, right=True)]
    source = positions + shifts
    valid = source < seq_end
    gathered = t.index_select(-1, source.clamp(max=length - 1))
    return torch.where(valid, gathered, torch.zeros((), dtype=t.dtype, device=t.device))


def _megatron_roll_once(t: torch.Tensor, dim: int, cp_group: dist.ProcessGroup,
                        cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """One zigzag-aware left shift through megatron-core's ``roll_tensor``."""
    try:
        from megatron.core.transformer.multi_token_prediction import roll_tensor
    except ImportError as exc:
        raise RuntimeError("roll_left with a CP group of size > 1 needs megatron-core's "
                           "roll_tensor (pip install megatron-core)") from exc
    params = inspect.signature(roll_tensor).parameters
    needed = ["shifts", "dims", "cp_group"] + (["packed_seq_params"] if cu_seqlens is not None
                                               else [])
    missing = [name for name in needed if name not in params]
    if missing:
        raise RuntimeError(f"megatron-core's roll_tensor{inspect.signature(roll_tensor)} lacks "
                           f"{missing}: zigzag-aware rolling is not supported on this version")
    kwargs: dict[str, Any] = {"shifts": -1, "dims": dim, "cp_group": cp_group}
    if cu_seqlens is not None:
        from megatron.core.packed_seq_params import PackedSeqParams
        kwargs["packed_seq_params"] = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu_seqlens.to(device=t.device, dtype=torch.int32))
    # roll_tensor writes into its chunks; keep the caller's tensor intact.
    result = roll_tensor(t.clone(), **kwargs)
    return result[0] if isinstance(result, tuple) else result
