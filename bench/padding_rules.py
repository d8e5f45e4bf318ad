"""Padding rules compared: ours (``trainer_client.padding.pad_multiple``) vs verl's.

Used by ``bench/mtp_loss.py`` and the padding tests only; the trainer pads with
:func:`~trainer_client.padding.pad_multiple` alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

from trainer_client.padding import check_int, pad_multiple


def verl_pad_multiple(tp: int, cp: int) -> int:
    """verl's multiple, ``tp * cp * 2`` when cp > 1 else ``tp``; kept for comparisons only.

    Raises:
        ValueError: as :func:`pad_multiple`.
    """
    tp = check_int("tp", tp, minimum=1)
    cp = check_int("cp", cp, minimum=1)
    return tp * cp * 2 if cp > 1 else tp



def padding_overhead(lengths: Iterable[int], tp: int, cp: int, *,
                     rule: Literal["ours", "verl"] = "ours", extra_multiple: int = 1) -> float:
    """Padded tokens per real token when every sequence is padded on its own (THD).

    Args:
        lengths: Real length of each sequence.
        tp: Tensor-parallel size.
        cp: Context-parallel size.
        rule: ``"ours"`` (:func:`pad_multiple`) or ``"verl"`` (:func:`verl_pad_multiple`),
            so a benchmark can compare the two on the same lengths.
        extra_multiple: Folded into the multiple through an lcm (both rules).

    Returns:
        ``sum(padded - length) / sum(length)``; 0.0 means no padding at all.

    Raises:
        ValueError: ``rule`` is unknown, ``lengths`` is empty or sums to zero (the ratio
            has no meaning), or a length / size is invalid.
    """
    if rule == "ours":
        multiple = pad_multiple(tp, cp, extra_multiple=extra_multiple)
    elif rule == "verl":
        multiple = math.lcm(verl_pad_multiple(tp, cp),
                            check_int("extra_multiple", extra_multiple, minimum=1))
    else:
        raise ValueError(f"rule must be 'ours' or 'verl', got {rule!r}")
    checked = [check_int(f"lengths[{i}]", length, minimum=0)
               for i, length in enumerate(lengths)]
    if not checked:
        raise ValueError("lengths is empty")
    num_real = sum(checked)
    if num_real == 0:
        raise ValueError("lengths sum to zero: the overhead ratio is undefined")
    num_padded = sum(-(-length // multiple) * multiple - length for length in checked)
    return num_padded / num_real
