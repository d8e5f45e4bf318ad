"""Sequence-length padding and zigzag splitting for context and tensor parallelism.

Runs in the trainer process, before the batch reaches Megatron; pure torch, no
communication. The rollout service never sees these lengths.

Why the multiple is what it is. With context parallelism (CP) Megatron cuts a
sequence into ``2 * cp`` equal chunks and gives rank ``r`` chunks ``r`` and
``2 * cp - 1 - r`` ("zigzag"), so every rank gets one early and one late chunk
and the causal-attention work is balanced; a rank then holds ``len / cp``
tokens. Sequence parallelism scatters those tokens over the ``tp`` ranks of the
tensor-parallel group. A length therefore has to satisfy

    len % (2 * cp) == 0   and   (len / cp) % tp == 0          (cp > 1)
    len % tp == 0                                              (cp == 1, no split)

For cp > 1 the second condition is ``len % (cp * tp) == 0``, so the lengths that
work are exactly the multiples of ``lcm(2 * cp, cp * tp) = cp * lcm(2, tp)``:
``cp * tp`` when tp is even, ``2 * cp * tp`` when tp is odd.

What the neighbours do. verl pads to ``tp * cp * 2`` when cp > 1 (else tp). It is
correct but pads twice as much as needed when tp is even (tp=8, cp=4: 64 instead
of 32). verl's earlier rule, ``lcm(tp, 2 * cp)``, is wrong: tp=4, cp=2 gives 4,
which leaves 2 tokens per CP rank to scatter over 4 TP ranks.

Packed rows (THD, :func:`packed_padded_lengths`). The two conditions fall on different
things there: the zigzag split cuts *each sequence* into ``2 * cp`` chunks, while
sequence parallelism scatters the *row* a CP rank holds. So each sequence is padded to
a multiple of ``2 * cp`` only, and the row's total to :func:`pad_multiple` by extending
the last sequence's padding: at most ``pad_multiple - 1`` tokens per row instead of up
to that many per sequence (tp=8, cp=4: each sequence to 8, not 32).

``extra_multiple`` is a further multiple of the *global* length (the padded row, before
any split), folded in through an lcm. It is not a per-rank rule: a requirement on each
rank's share, ``r`` tokens per CP rank or per CP x TP rank, is ``extra_multiple = cp * r``
or ``cp * tp * r``. No kernel's requirement (e.g. FP8 GEMMs in Transformer Engine, which
constrain the token count of each rank's matrix products) is encoded here.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch

__all__ = [
    "pad_multiple",
    "packed_padded_lengths",
    "padded_length",
    "sequence_multiple",
    "zigzag_merge",
    "zigzag_split",
    "zigzag_split_packed",
]


def check_int(name: str, value: object, *, minimum: int) -> int:
    """Return ``value`` as an int, refusing bools, non-integers and values below ``minimum``."""
    # bool is an int subclass: tp=True would silently mean tp=1.
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got bool {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {type(value).__name__} {value!r}") \
            from None
    if number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {number}")
    return number


def pad_multiple(tp: int, cp: int, *, extra_multiple: int = 1) -> int:
    """The least ``m`` such that every multiple of ``m`` is a valid length for (tp, cp).

    Args:
        tp: Tensor-parallel size (sequence parallelism scatters tokens over it).
        cp: Context-parallel size (zigzag split into ``2 * cp`` chunks when > 1).
        extra_multiple: A further multiple of the global length (module docstring).

    Returns:
        ``lcm(2 * cp, cp * tp, extra_multiple)`` when cp > 1, ``lcm(tp, extra_multiple)``
        when cp == 1 (see the module docstring for why).

    Raises:
        ValueError: a size is not an integer or is below 1; the message names it.
    """
    tp = check_int("tp", tp, minimum=1)
    cp = check_int("cp", cp, minimum=1)
    extra_multiple = check_int("extra_multiple", extra_multiple, minimum=1)
    base = tp if cp == 1 else math.lcm(2 * cp, cp * tp)
    return math.lcm(base, extra_multiple)


def padded_length(length: int, tp: int, cp: int, extra_multiple: int = 1) -> int:
    """Round ``length`` up to the next multiple of :func:`pad_multiple`.

    Args:
        length: Real number of tokens (0 stays 0).
        tp: Tensor-parallel size.
        cp: Context-parallel size.
        extra_multiple: A further multiple of the global length (module docstring).

    Returns:
        The least valid length that is ``>= length``.

    Raises:
        ValueError: ``length`` is negative, or an argument is not an integer or out of
            range; the message names it.
    """
    length = check_int("length", length, minimum=0)
    multiple = pad_multiple(tp, cp, extra_multiple=extra_multiple)
    return -(-length // multiple) * multiple


def sequence_multiple(cp: int) -> int:
    """What each sequence of a packed row is padded to: ``2 * cp`` (1 without CP).

    Raises:
        ValueError: ``cp`` is not an integer >= 1.
    """
    cp = check_int("cp", cp, minimum=1)
    return 2 * cp if cp > 1 else 1


def packed_padded_lengths(lengths: Sequence[int], tp: int, cp: int,
                          extra_multiple: int = 1) -> list[int]:
    """Padded length of each sequence of one packed (THD) row.

    Each sequence is rounded up to :func:`sequence_multiple` (what the zigzag split
    needs); then the last one grows until the row's total is a multiple of
    :func:`pad_multiple` (what the SP scatter of each CP rank's share needs, and
    ``extra_multiple``). Every entry stays a multiple of ``2 * cp``, the total is the
    least valid total, and no sequence but the last is padded past its own multiple.

    Args:
        lengths: Real length of each sequence, in packing order; at least one.
        tp: Tensor-parallel size.
        cp: Context-parallel size.
        extra_multiple: A further multiple of the row's total (module docstring).

    Returns:
        One padded length per sequence.

    Raises:
        ValueError: ``lengths`` is empty, a length is negative or not an integer, or a
            size is invalid; the message names it.
    """
    checked = [check_int(f"lengths[{i}]", length, minimum=0)
               for i, length in enumerate(lengths)]
    if not checked:
        raise ValueError("lengths is empty")
    each = sequence_multiple(cp)
    padded = [-(-length // each) * each for length in checked]
    padded[-1] += padded_length(sum(padded), tp, cp, extra_multiple) - sum(padded)
    return padded


def zigzag_split(x: torch.Tensor, cp: int, dim: int = 1) -> list[torch.Tensor]:
    """Split ``x`` along ``dim`` the way context parallelism does.

    Args:
        x: A tensor whose ``dim`` is the sequence (dim 1 for ``[B, S, ...]``).
        cp: Context-parallel size.
        dim: The sequence dim.

    Returns:
        ``cp`` tensors; entry ``r`` is chunk ``r`` followed by chunk ``2 * cp - 1 - r``
        of ``2 * cp`` equal chunks (with cp == 1: the whole tensor).

    Raises:
        ValueError: ``cp`` is invalid, or the length along ``dim`` is not a multiple of
            ``2 * cp`` (pad it with :func:`padded_length` first).
    """
    cp = check_int("cp", cp, minimum=1)
    if cp == 1:
        return [x]
    seq_len = x.size(dim)
    if seq_len % (2 * cp) != 0:
        raise ValueError(f"x.size({dim}) = {seq_len} is not a multiple of 2 * cp = {2 * cp}")
    chunks = x.chunk(2 * cp, dim=dim)
    return [torch.cat([chunks[r], chunks[2 * cp - 1 - r]], dim=dim) for r in range(cp)]


def zigzag_merge(parts: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`zigzag_split`: put the ranks' parts back in sequence order.

    Args:
        parts: One tensor per CP rank, in rank order.
        dim: The sequence dim.

    Returns:
        The full sequence along ``dim``.

    Raises:
        ValueError: ``parts`` is empty, or the parts differ in length or have an odd
            length along ``dim`` (they cannot come from one zigzag split).
    """
    if not parts:
        raise ValueError("parts is empty")
    cp = len(parts)
    if cp == 1:
        return parts[0]
    sizes = {part.size(dim) for part in parts}
    if len(sizes) != 1 or next(iter(sizes)) % 2 != 0:
        raise ValueError(f"parts must share one even length along dim {dim}, got "
                         f"{[part.size(dim) for part in parts]}")
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for r, part in enumerate(parts):
        chunks[r], chunks[2 * cp - 1 - r] = part.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


def zigzag_split_packed(x: torch.Tensor, cu_seqlens_padded: torch.Tensor | Sequence[int],
                        cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """One CP rank's tokens of a packed (THD) tensor: each sequence is zigzag-split alone.

    A packed row holds several sequences back to back; splitting the whole row
    would hand one rank whole sequences and another none. Each sequence's padded
    length is a multiple of ``2 * cp`` (see :func:`packed_padded_lengths`), so each
    splits cleanly.

    Args:
        x: Packed tensor; ``dim`` is the token dim (dim 1 for ``[1, T]``).
        cu_seqlens_padded: ``[num_seqs + 1]`` padded sequence boundaries, starting at 0
            and ending at ``x.size(dim)``.
        cp: Context-parallel size.
        rank: The CP rank, in ``[0, cp)``.
        dim: The token dim.

    Returns:
        For each sequence in order, its chunk ``rank`` then chunk ``2 * cp - 1 - rank``,
        concatenated along ``dim`` (``T / cp`` tokens in all).

    Raises:
        ValueError: ``cp`` or ``rank`` is out of range, or ``cu_seqlens_padded`` does not
            start at 0, decreases, does not end at ``x.size(dim)``, or has a sequence whose
            padded length is not a multiple of ``2 * cp`` (when cp > 1).
    """
    cp = check_int("cp", cp, minimum=1)
    rank = check_int("rank", rank, minimum=0)
    if rank >= cp:
        raise ValueError(f"rank must be < cp = {cp}, got {rank}")
    bounds = [int(b) for b in (cu_seqlens_padded.tolist()
                               if isinstance(cu_seqlens_padded, torch.Tensor)
                               else cu_seqlens_padded)]
    if not bounds or bounds[0] != 0 or bounds[-1] != x.size(dim):
        raise ValueError(f"cu_seqlens_padded must start at 0 and end at x.size({dim}) = "
                         f"{x.size(dim)}, got {bounds}")
    each = sequence_multiple(cp)
    pieces = []
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if end < start or (end - start) % each != 0:
            raise ValueError(f"cu_seqlens_padded: sequence {i} spans [{start}, {end}), "
                             f"not a non-negative multiple of {each} (2 * cp, 1 without CP)")
        if end > start:
            pieces.append(zigzag_split(x.narrow(dim, start, end - start), cp, dim)[rank])
    if not pieces:
        return x.narrow(dim, 0, 0)
    return torch.cat(pieces, dim=dim)
