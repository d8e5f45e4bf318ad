"""Padding rules compared: ours (``trainer_client.padding``), its per-sequence predecessor, verl's.

Used by ``bench/mtp_loss.py`` and the padding tests only; the trainer pads with
:func:`~trainer_client.padding.packed_padded_lengths` (THD) and
:func:`~trainer_client.padding.padded_length` (BSHD) alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

from trainer_client.padding import check_int, packed_padded_lengths, pad_multiple

Rule = Literal["ours", "lcm_per_sequence", "verl"]
"""How a packed row is padded:

- ``"ours"``: each sequence to ``2 * cp``, the row's total to ``pad_multiple(tp, cp)``
  (``packed_padded_lengths``);
- ``"lcm_per_sequence"``: each sequence to ``pad_multiple(tp, cp) = lcm(2 * cp, cp * tp)``
  (this project's THD rule before);
- ``"verl"``: each sequence to :func:`verl_pad_multiple`.
"""


def verl_pad_multiple(tp: int, cp: int) -> int:
    """verl's multiple, ``tp * cp * 2`` when cp > 1 else ``tp``; kept for comparisons only.

    Raises:
        ValueError: as :func:`pad_multiple`.
    """
    tp = check_int("tp", tp, minimum=1)
    cp = check_int("cp", cp, minimum=1)
    return tp * cp * 2 if cp > 1 else tp


def padding_overhead(lengths: Iterable[int], tp: int, cp: int, *, rule: Rule = "ours",
                     extra_multiple: int = 1, sequences_per_row: int | None = None) -> float:
    """Padded tokens per real token when the sequences are packed into THD rows.

    Args:
        lengths: Real length of each sequence, in packing order.
        tp: Tensor-parallel size.
        cp: Context-parallel size.
        rule: One of :data:`Rule`, so a benchmark can compare them on the same lengths.
        extra_multiple: A further multiple of each row's total (``"ours"``) or of each
            sequence (the per-sequence rules), folded in through an lcm.
        sequences_per_row: How many consecutive sequences share a row (the last row may
            hold fewer); None: all in one row. Only ``"ours"`` pads per row.

    Returns:
        ``sum(padded - length) / sum(length)``; 0.0 means no padding at all.

    Raises:
        ValueError: ``rule`` is unknown, ``lengths`` is empty or sums to zero (the ratio
            has no meaning), or a length / size is invalid.
    """
    if rule not in ("ours", "lcm_per_sequence", "verl"):
        raise ValueError(f"rule must be 'ours', 'lcm_per_sequence' or 'verl', got {rule!r}")
    checked = [check_int(f"lengths[{i}]", length, minimum=0)
               for i, length in enumerate(lengths)]
    if not checked:
        raise ValueError("lengths is empty")
    num_real = sum(checked)
    if num_real == 0:
        raise ValueError("lengths sum to zero: the overhead ratio is undefined")
    extra = check_int("extra_multiple", extra_multiple, minimum=1)
    if rule == "ours":
        per_row = len(checked) if sequences_per_row is None else check_int(
            "sequences_per_row", sequences_per_row, minimum=1)
        num_padded = sum(sum(packed_padded_lengths(checked[i:i + per_row], tp, cp, extra))
                         for i in range(0, len(checked), per_row))
        return (num_padded - num_real) / num_real
    multiple = (pad_multiple(tp, cp, extra_multiple=extra) if rule == "lcm_per_sequence"
                else math.lcm(verl_pad_multiple(tp, cp), extra))
    num_padded = sum(-(-length // multiple) * multiple for length in checked)
    return (num_padded - num_real) / num_real
