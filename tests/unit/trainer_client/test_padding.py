"""Padding multiples for CP/TP, zigzag splits and the overhead comparison with verl (CPU)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.padding_rules import padding_overhead, verl_pad_multiple
from trainer_client.padding import (
    pad_multiple,
    padded_length,
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
    assert padding_overhead(lengths, 8, 4) < padding_overhead(lengths, 8, 4, rule="verl")


def test_verl_old_lcm_rule_breaks_tp_condition() -> None:
    tp, cp = 4, 2
    old = math.lcm(tp, 2 * cp)
    assert old == 4
    assert not is_valid_length(old, tp, cp)  # 2 tokens per CP rank for 4 TP ranks
    assert pad_multiple(tp, cp) == 8


def test_padding_overhead_values() -> None:
    # tp=2, cp=2: multiple 4 (ours) vs 8 (verl).
    assert padding_overhead([4, 5], 2, 2) == pytest.approx(3 / 9)
    assert padding_overhead([4, 5], 2, 2, rule="verl") == pytest.approx((4 + 3) / 9)
    assert padding_overhead([8, 16], 2, 2) == 0.0
    assert padding_overhead([1], 1, 1) == 0.0
    assert padding_overhead([15], 1, 1, extra_multiple=16) == pytest.approx(1 / 15)


@settings(max_examples=60, deadline=None)
@given(tp=st.integers(1, 8), cp=st.integers(1, 8),
       lengths=st.lists(st.integers(1, 5000), min_size=1, max_size=20))
def test_padding_overhead_ours_le_verl(tp: int, cp: int, lengths: list[int]) -> None:
    assert 0.0 <= padding_overhead(lengths, tp, cp) <= padding_overhead(lengths, tp, cp,
                                                                        rule="verl")


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
