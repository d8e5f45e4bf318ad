"""Padding multiples for CP/TP, packed rows, zigzag splits and the overhead comparison (CPU)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.padding_rules import padding_overhead, verl_pad_multiple
from trainer_client.padding import (
    packed_padded_lengths,
    pad_multiple,
    padded_length,
    sequence_multiple,
    zigzag_merge,
    zigzag_split,
    zigzag_split_packed,
)

SIZES = range(1, 9)
GRID = [(tp, cp) for tp in SIZES for cp in SIZES]


def is_valid_length(length: int, tp: int, cp: int) -> bool:
    """The two conditions, written from the definition (not from the formula under test)."""
    if cp == 1:
        return length % tp == 0
    return length % (2 * cp) == 0 and (length // cp) % tp == 0


@pytest.mark.parametrize(("tp", "cp"), GRID)
def test_pad_multiple_is_exactly_the_set_of_valid_lengths(tp: int, cp: int) -> None:
    m = pad_multiple(tp, cp)
    # Brute force up to twice verl's product: a length is valid iff it is a multiple of m.
    for length in range(0, 4 * tp * cp + 1):
        assert is_valid_length(length, tp, cp) == (length % m == 0), length
    assert m == min(n for n in range(1, 2 * tp * cp + 1) if is_valid_length(n, tp, cp))


@pytest.mark.parametrize(("tp", "cp"), GRID)
def test_pad_multiple_formula(tp: int, cp: int) -> None:
    expected = tp if cp == 1 else math.lcm(2 * cp, cp * tp)
    assert pad_multiple(tp, cp) == expected


@settings(max_examples=200, deadline=None)
@given(tp=st.integers(1, 8), cp=st.integers(1, 8), length=st.integers(0, 100_000))
def test_padded_length_is_the_least_valid_length_at_or_above(tp: int, cp: int,
                                                            length: int) -> None:
    padded = padded_length(length, tp, cp)
    assert padded >= length
    assert is_valid_length(padded, tp, cp)
    assert not any(is_valid_length(n, tp, cp) for n in range(length, padded))


@settings(max_examples=60, deadline=None)
@given(tp=st.integers(1, 8), cp=st.integers(1, 8), length=st.integers(0, 10_000),
       extra=st.sampled_from([1, 3, 16]))
def test_extra_multiple_is_folded_in_by_lcm(tp: int, cp: int, length: int, extra: int) -> None:
    assert pad_multiple(tp, cp, extra_multiple=extra) == math.lcm(pad_multiple(tp, cp), extra)
    padded = padded_length(length, tp, cp, extra)
    assert padded % extra == 0 and is_valid_length(padded, tp, cp)
    assert not any(n % extra == 0 and is_valid_length(n, tp, cp) for n in range(length, padded))


@settings(max_examples=60, deadline=None)
@given(tp=st.integers(1, 8), cp=st.integers(1, 8), length=st.integers(0, 10_000),
       per_rank=st.sampled_from([1, 8, 16]))
def test_extra_multiple_is_global_and_a_per_rank_rule_is_cp_tp_times_it(
        tp: int, cp: int, length: int, per_rank: int) -> None:
    # The docstring's example: 16 on the global length leaves 4 tokens per rank here.
    assert padded_length(1, 2, 2, extra_multiple=16) // (2 * 2) == 4
    padded = padded_length(length, tp, cp, extra_multiple=cp * tp * per_rank)
    assert is_valid_length(padded, tp, cp) and (padded // (cp * tp)) % per_rank == 0


def brute_force_packed_total(lengths: list[int], tp: int, cp: int, extra: int) -> int:
    """The least total over every way of padding each sequence to a multiple of 2cp (any
    multiple, not only the next one) such that the row's total is a valid length and a
    multiple of ``extra``: written from the definitions, by enumeration."""
    each = 2 * cp if cp > 1 else 1
    bound = 2 * tp * cp * extra  # no sequence ever needs more than this beyond its length
    choices = [range(-(-n // each) * each, n + bound + 1, each) for n in lengths]
    totals = [sum(combo) for combo in itertools.product(*choices)
              if is_valid_length(sum(combo), tp, cp) and sum(combo) % extra == 0]
    return min(totals)


@settings(max_examples=150, deadline=None)
@given(tp=st.integers(1, 4), cp=st.integers(1, 3), extra=st.sampled_from([1, 3, 16]),
       lengths=st.lists(st.integers(0, 40), min_size=1, max_size=3))
def test_packed_padded_lengths_against_brute_force(tp: int, cp: int, extra: int,
                                                   lengths: list[int]) -> None:
    padded = packed_padded_lengths(lengths, tp, cp, extra)
    each = 2 * cp if cp > 1 else 1
    assert sequence_multiple(cp) == each
    assert len(padded) == len(lengths)
    assert all(p >= n and p % each == 0 for p, n in zip(padded, lengths, strict=True))
    # Only the last sequence carries the row's padding; the others stop at their multiple.
    assert all(p == min(m for m in range(n, n + each) if m % each == 0)
               for p, n in zip(padded[:-1], lengths, strict=False))
    assert sum(padded) == brute_force_packed_total(lengths, tp, cp, extra)


@settings(max_examples=100, deadline=None)
@given(tp=st.integers(1, 8), cp=st.integers(1, 8),
       lengths=st.lists(st.integers(0, 5000), min_size=1, max_size=20))
def test_packed_rows_split_and_scatter_cleanly(tp: int, cp: int, lengths: list[int]) -> None:
    padded = packed_padded_lengths(lengths, tp, cp)
    total = sum(padded)
    assert is_valid_length(total, tp, cp)  # each CP rank's T / cp tokens scatter over TP
    assert total == padded_length(sum(-(-n // sequence_multiple(cp)) * sequence_multiple(cp)
                                      for n in lengths), tp, cp)
    bounds = list(itertools.accumulate(padded, initial=0))
    x = torch.arange(total).unsqueeze(0)
    per_rank = [zigzag_split_packed(x, bounds, cp, rank) for rank in range(cp)]
    assert all(part.size(1) == total // cp and part.size(1) % tp == 0 for part in per_rank)


def test_packed_rows_pad_each_sequence_to_2cp_only() -> None:
    # tp=8, cp=4: each sequence to 8 (not 32); the row's total to 32 (3096 -> 3104).
    assert packed_padded_lengths([1000, 33, 2049], tp=8, cp=4) == [1000, 40, 2064]
    assert [padded_length(n, tp=8, cp=4) for n in [1000, 33, 2049]] == [1024, 64, 2080]
    # Without CP nothing is padded per sequence; the row goes to a multiple of tp.
    assert packed_padded_lengths([5, 4], tp=4, cp=1) == [5, 7]
    assert packed_padded_lengths([5, 3], tp=1, cp=1) == [5, 3]


@pytest.mark.parametrize(("tp", "cp"), GRID)
def test_ours_never_pads_more_than_verl(tp: int, cp: int) -> None:
    ours, verl = pad_multiple(tp, cp), verl_pad_multiple(tp, cp)
    assert verl % ours == 0
    # Odd tp (or no CP) needs verl's full product; even tp needs half of it.
    assert verl == (2 * ours if cp > 1 and tp % 2 == 0 else ours)


def test_tp8_cp4_is_half_of_verl() -> None:
    assert pad_multiple(8, 4) == 32
    assert verl_pad_multiple(8, 4) == 64
    lengths = [1000, 33, 2049]
    ours, before, verl = (padding_overhead(lengths, 8, 4, rule=rule)
                          for rule in ("ours", "lcm_per_sequence", "verl"))
    assert ours == pytest.approx((3104 - 3082) / 3082)
    assert before == pytest.approx((1024 + 64 + 2080 - 3082) / 3082)
    assert ours < before < verl


def test_verl_old_lcm_rule_breaks_tp_condition() -> None:
    tp, cp = 4, 2
    old = math.lcm(tp, 2 * cp)
    assert old == 4
    assert not is_valid_length(old, tp, cp)  # 2 tokens per CP rank for 4 TP ranks
    assert pad_multiple(tp, cp) == 8


def test_padding_overhead_values() -> None:
    # tp=2, cp=2: each sequence to 4 and the row to 4 (ours, and before) vs 8 (verl).
    assert padding_overhead([4, 5], 2, 2) == pytest.approx(3 / 9)
    assert padding_overhead([4, 5], 2, 2, rule="lcm_per_sequence") == pytest.approx(3 / 9)
    assert padding_overhead([4, 5], 2, 2, rule="verl") == pytest.approx((4 + 3) / 9)
    assert padding_overhead([8, 16], 2, 2) == 0.0
    assert padding_overhead([1], 1, 1) == 0.0
    assert padding_overhead([15], 1, 1, extra_multiple=16) == pytest.approx(1 / 15)
    # tp=4, cp=2: each sequence to 4 (ours) or 8 (before); rows of two to 8 (ours).
    assert padding_overhead([5, 9, 5, 9], 4, 2, sequences_per_row=2) == \
        pytest.approx((2 * (8 + 16) - 28) / 28)
    assert padding_overhead([5, 9, 5, 9], 4, 2) == pytest.approx((8 + 12 + 8 + 12 - 28) / 28)
    assert padding_overhead([5, 9, 5, 9], 4, 2, rule="lcm_per_sequence") == \
        pytest.approx((2 * (8 + 16) - 28) / 28)


@settings(max_examples=60, deadline=None)
@given(tp=st.integers(1, 8), cp=st.integers(1, 8), per_row=st.integers(1, 20),
       lengths=st.lists(st.integers(1, 5000), min_size=1, max_size=20))
def test_padding_overhead_ours_le_before_le_verl(tp: int, cp: int, per_row: int,
                                                 lengths: list[int]) -> None:
    ours = padding_overhead(lengths, tp, cp, sequences_per_row=per_row)
    before = padding_overhead(lengths, tp, cp, rule="lcm_per_sequence")
    assert 0.0 <= ours <= before <= padding_overhead(lengths, tp, cp, rule="verl")


@pytest.mark.parametrize(("call", "field"), [
    (lambda: pad_multiple(0, 1), "tp"),
    (lambda: pad_multiple(1, 0), "cp"),
    (lambda: pad_multiple(-2, 1), "tp"),
    (lambda: pad_multiple(True, 2), "tp"),
    (lambda: pad_multiple(2, 2.0), "cp"),
    (lambda: pad_multiple(2, 2, extra_multiple=0), "extra_multiple"),
    (lambda: padded_length(-1, 1, 1), "length"),
    (lambda: padded_length(3.0, 1, 1), "length"),
    (lambda: padded_length("3", 1, 1), "length"),
    (lambda: padded_length(False, 1, 1), "length"),
    (lambda: padded_length(3, 0, 1), "tp"),
    (lambda: padded_length(3, 1, None), "cp"),
    (lambda: verl_pad_multiple(1, 0), "cp"),
    (lambda: padding_overhead([], 1, 1), "lengths"),
    (lambda: padding_overhead([0, 0], 1, 1), "lengths"),
    (lambda: padding_overhead([4, -1], 1, 1), r"lengths\[1\]"),
    (lambda: padding_overhead([4], 1, 1, rule="nemo"), "rule"),
    (lambda: padding_overhead([4], 0, 1, rule="verl"), "tp"),
    (lambda: padding_overhead([4], 1, 1, sequences_per_row=0), "sequences_per_row"),
    (lambda: packed_padded_lengths([], 1, 1), "lengths"),
    (lambda: packed_padded_lengths([3, -1], 1, 1), r"lengths\[1\]"),
    (lambda: packed_padded_lengths([3], 1, 0), "cp"),
    (lambda: packed_padded_lengths([3], 1, 1, extra_multiple=0), "extra_multiple"),
    (lambda: sequence_multiple(0), "cp"),
    (lambda: zigzag_split(torch.zeros(1, 6), 2), r"2 \* cp"),
    (lambda: zigzag_split(torch.zeros(1, 8), 0), "cp"),
    (lambda: zigzag_merge([]), "parts"),
    (lambda: zigzag_merge([torch.zeros(1, 2), torch.zeros(1, 4)]), "parts"),
    (lambda: zigzag_split_packed(torch.zeros(1, 8), [0, 8], 2, 2), "rank"),
    (lambda: zigzag_split_packed(torch.zeros(1, 8), [0, 6, 8], 2, 0), "cu_seqlens_padded"),
    (lambda: zigzag_split_packed(torch.zeros(1, 8), [0, 4], 2, 0), "cu_seqlens_padded"),
    (lambda: zigzag_split_packed(torch.zeros(1, 8), [4, 8], 2, 0), "cu_seqlens_padded"),
])
def test_bad_input_raises_value_error_naming_the_field(call, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        call()


@settings(max_examples=60, deadline=None)
@given(cp=st.integers(1, 8), chunk=st.integers(1, 5), batch=st.integers(1, 3),
       dim=st.sampled_from([0, 1, -1]))
def test_zigzag_split_merge_round_trip_and_chunk_placement(cp: int, chunk: int, batch: int,
                                                           dim: int) -> None:
    seq_len = 2 * cp * chunk
    # Sequence along `dim`, a batch-like dim beside it; values encode the position.
    x = torch.arange(seq_len).unsqueeze(1).expand(seq_len, batch)
    x = x if dim == 0 else x.T.contiguous()
    parts = zigzag_split(x, cp, dim)
    assert len(parts) == cp
    chunks = x.chunk(2 * cp, dim=dim)
    for r, part in enumerate(parts):
        assert part.size(dim) == seq_len // cp
        if cp > 1:
            assert torch.equal(part, torch.cat([chunks[r], chunks[2 * cp - 1 - r]], dim=dim))
    # Positions held by rank r: chunk r then chunk 2cp-1-r, written out by hand.
    for r, part in enumerate(parts):
        positions = part[:, 0] if dim == 0 else part[0]
        if cp > 1:
            expected = ([r * chunk + i for i in range(chunk)]
                        + [(2 * cp - 1 - r) * chunk + i for i in range(chunk)])
            assert positions.tolist() == expected
    assert torch.equal(zigzag_merge(parts, dim), x)


@settings(max_examples=60, deadline=None)
@given(cp=st.integers(1, 4),
       num_chunks=st.lists(st.integers(0, 4), min_size=1, max_size=5))
def test_zigzag_split_packed_splits_each_sequence(cp: int, num_chunks: list[int]) -> None:
    padded = [2 * cp * n for n in num_chunks]
    bounds = [0]
    for length in padded:
        bounds.append(bounds[-1] + length)
    x = torch.arange(bounds[-1]).unsqueeze(0)
    cu = torch.tensor(bounds, dtype=torch.int32)
    per_rank = [zigzag_split_packed(x, cu, cp, rank) for rank in range(cp)]
    for rank, tokens in enumerate(per_rank):
        assert tokens.size(1) == bounds[-1] // cp
        expected = [zigzag_split(x[:, s:e], cp)[rank] for s, e in zip(bounds, bounds[1:])
                    if e > s]
        assert torch.equal(tokens, torch.cat(expected, dim=1) if expected else x[:, :0])
    all_tokens = torch.cat(per_rank, dim=1).flatten().tolist()
    assert sorted(all_tokens) == list(range(bounds[-1]))
