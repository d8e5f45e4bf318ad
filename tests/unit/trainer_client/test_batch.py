"""Rollouts to padded (BSHD) and packed (THD) batches: the loss mask and labels (CPU)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer_client.batch import PackedBatch, PaddedBatch, Rollout, pack_padded, pack_thd
from trainer_client.padding import (
    packed_padded_lengths,
    padded_length,
    sequence_multiple,
    zigzag_split_packed,
)

PAD_ID = 0


@st.composite
def rollouts(draw: st.DrawFn) -> Rollout:
    num_prompt = draw(st.integers(1, 12))
    num_response = draw(st.integers(1, 12))
    tokens = st.integers(1, 999)  # 0 is PAD_ID: keeps "is this padding" unambiguous below
    mask = draw(st.none() | st.lists(st.integers(0, 1), min_size=num_response,
                                     max_size=num_response))
    logprobs = draw(st.none() | st.just([-0.5] * num_response))
    return Rollout(prompt_ids=draw(st.lists(tokens, min_size=num_prompt, max_size=num_prompt)),
                   response_ids=draw(st.lists(tokens, min_size=num_response,
                                              max_size=num_response)),
                   response_mask=mask, reward=draw(st.floats(-1, 1)), old_logprobs=logprobs)


batches = st.lists(rollouts(), min_size=1, max_size=5).map(
    # old_logprobs must be given for all rollouts or none.
    lambda rs: rs if all(r.old_logprobs is not None for r in rs) else [
        Rollout(prompt_ids=r.prompt_ids, response_ids=r.response_ids,
                response_mask=r.response_mask, reward=r.reward) for r in rs])
sizes = st.integers(1, 4)


def expected_row_mask(rollout: Rollout, length: int) -> list[float]:
    """Position t is trained iff token t+1 is a response token with response_mask 1."""
    response_mask = rollout.response_mask or [1] * len(rollout.response_ids)
    token_mask = [0] * len(rollout.prompt_ids) + response_mask
    return [float(token_mask[t + 1]) if t + 1 < rollout.num_tokens else 0.0
            for t in range(length)]


@settings(max_examples=50, deadline=None)
@given(rs=batches, tp=sizes, cp=sizes)
def test_padded_loss_mask_and_labels(rs: list[Rollout], tp: int, cp: int) -> None:
    batch = pack_padded(rs, tp, cp, PAD_ID)
    num_seqs, seq_len = batch.input_ids.shape
    assert num_seqs == len(rs)
    assert seq_len == padded_length(max(r.num_tokens for r in rs), tp, cp)
    for name in ("attention_mask", "position_ids", "labels", "loss_mask"):
        assert getattr(batch, name).shape == (num_seqs, seq_len), name
    for b, r in enumerate(rs):
        length, num_prompt = r.num_tokens, len(r.prompt_ids)
        assert batch.input_ids[b, :length].tolist() == r.prompt_ids + r.response_ids
        assert (batch.input_ids[b, length:] == PAD_ID).all()
        assert batch.attention_mask[b].tolist() == [t < length for t in range(seq_len)]
        assert batch.position_ids[b].tolist() == list(range(seq_len))
        assert batch.loss_mask[b].tolist() == expected_row_mask(r, seq_len)
        assert int(batch.response_start[b]) == num_prompt
        assert int(batch.seq_lengths[b]) == length
        assert batch.rewards[b].item() == pytest.approx(r.reward)
        # Targets of trained positions are response tokens, never prompt or padding.
        trained = batch.loss_mask[b].nonzero().flatten().tolist()
        assert all(num_prompt <= t + 1 < length for t in trained)
    # Labels are the next input token (everywhere but the last column, which is pad_id).
    assert torch.equal(batch.labels[:, :-1], batch.input_ids[:, 1:])
    assert (batch.labels[:, -1] == PAD_ID).all()
    if rs[0].old_logprobs is None:
        assert batch.old_logprobs is None
    else:
        assert torch.equal(batch.old_logprobs, -0.5 * batch.loss_mask)


@settings(max_examples=50, deadline=None)
@given(rs=batches, tp=sizes, cp=sizes)
def test_packed_loss_mask_labels_and_boundaries(rs: list[Rollout], tp: int, cp: int) -> None:
    batch = pack_thd(rs, tp, cp, PAD_ID)
    lengths = [r.num_tokens for r in rs]
    padded = packed_padded_lengths(lengths, tp, cp)
    # Each sequence to 2cp (the last one also carries the row's padding), the row to the
    # padded-row multiple.
    assert all(p % sequence_multiple(cp) == 0 for p in padded)
    assert sum(padded) == padded_length(sum(padded), tp, cp)
    cu, cu_padded = batch.cu_seqlens.tolist(), batch.cu_seqlens_padded.tolist()
    assert batch.cu_seqlens.dtype == batch.cu_seqlens_padded.dtype == torch.int32
    assert cu[0] == cu_padded[0] == 0
    assert [e - s for s, e in zip(cu, cu[1:])] == lengths
    assert [e - s for s, e in zip(cu_padded, cu_padded[1:])] == padded
    assert all(c <= p for c, p in zip(cu, cu_padded))
    total = cu_padded[-1]
    for name in ("input_ids", "position_ids", "labels", "loss_mask"):
        assert getattr(batch, name).shape == (1, total), name
    ids, labels, mask = batch.input_ids[0], batch.labels[0], batch.loss_mask[0]
    for i, r in enumerate(rs):
        start, end = cu_padded[i], cu_padded[i + 1]
        length = lengths[i]
        assert ids[start:start + length].tolist() == r.prompt_ids + r.response_ids
        assert (ids[start + length:end] == PAD_ID).all()
        assert batch.position_ids[0, start:end].tolist() == list(range(end - start))
        assert mask[start:end].tolist() == expected_row_mask(r, end - start)
        # Next-token labels inside the sequence; nothing crosses into the next one.
        assert torch.equal(labels[start:start + length - 1], ids[start + 1:start + length])
        assert (labels[start + length - 1:end] == PAD_ID).all()
        assert mask[start + length - 1] == 0
    trained = mask.nonzero().flatten().tolist()
    for t in trained:
        seq = max(i for i in range(len(rs)) if cu_padded[i] <= t)
        offset = t - cu_padded[seq]
        assert len(rs[seq].prompt_ids) <= offset + 1 < lengths[seq]
        assert labels[t] == ids[t + 1]
    if rs[0].old_logprobs is not None:
        assert torch.equal(batch.old_logprobs, -0.5 * batch.loss_mask)


@settings(max_examples=20, deadline=None)
@given(rs=batches, tp=sizes, cp=sizes)
def test_both_layouts_agree_per_sequence(rs: list[Rollout], tp: int, cp: int) -> None:
    padded_batch, packed = pack_padded(rs, tp, cp, PAD_ID), pack_thd(rs, tp, cp, PAD_ID)
    for i, r in enumerate(rs):
        start, length = int(packed.cu_seqlens_padded[i]), r.num_tokens
        for name in ("input_ids", "labels", "loss_mask"):
            assert torch.equal(getattr(packed, name)[0, start:start + length],
                               getattr(padded_batch, name)[i, :length]), name


def test_multi_turn_tool_output_is_not_trained() -> None:
    # prompt [1 2], response: model [3 4], tool [5 6], model [7].
    r = Rollout(prompt_ids=[1, 2], response_ids=[3, 4, 5, 6, 7],
                response_mask=[1, 1, 0, 0, 1], old_logprobs=[-0.1, -0.2, 0.0, 0.0, -0.3])
    batch = pack_padded([r], tp=2, cp=2, pad_id=9)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 9]]
    assert batch.labels.tolist() == [[2, 3, 4, 5, 6, 7, 9, 9]]
    assert batch.loss_mask.tolist() == [[0, 1, 1, 0, 0, 1, 0, 0]]
    assert batch.old_logprobs[0].tolist() == pytest.approx([0, -0.1, -0.2, 0, 0, -0.3, 0, 0])


def test_packed_batch_splits_cleanly_over_cp_ranks() -> None:
    rs = [Rollout(prompt_ids=[1] * 3, response_ids=[2] * 4),
          Rollout(prompt_ids=[3] * 10, response_ids=[4] * 9)]
    batch = pack_thd(rs, tp=2, cp=2, pad_id=0)
    assert batch.cu_seqlens.tolist() == [0, 7, 26]
    assert batch.cu_seqlens_padded.tolist() == [0, 8, 28]
    parts = [zigzag_split_packed(batch.input_ids, batch.cu_seqlens_padded, 2, rank)
             for rank in range(2)]
    assert [p.size(1) for p in parts] == [14, 14]


def test_packed_row_pads_sequences_to_2cp_and_the_row_to_the_sp_multiple() -> None:
    # tp=8, cp=2: each sequence to 4 (7 -> 8, 19 -> 20), the row to lcm(4, 16) = 16:
    # 28 -> 32, the last sequence's padding grows by 4. (Before: each sequence to 16.)
    rs = [Rollout(prompt_ids=[1] * 3, response_ids=[2] * 4),
          Rollout(prompt_ids=[3] * 10, response_ids=[4] * 9)]
    batch = pack_thd(rs, tp=8, cp=2, pad_id=0)
    assert batch.cu_seqlens_padded.tolist() == [0, 8, 32]
    parts = [zigzag_split_packed(batch.input_ids, batch.cu_seqlens_padded, 2, rank)
             for rank in range(2)]
    assert [p.size(1) for p in parts] == [16, 16]  # 16 per CP rank: 2 per TP rank
    assert batch.loss_mask[0, 26:].sum() == 0 and (batch.labels[0, 26:] == 0).all()


def rollout(**overrides: object) -> Rollout:
    fields: dict[str, object] = {"prompt_ids": [1, 2], "response_ids": [3, 4]}
    return Rollout(**(fields | overrides))


@pytest.mark.parametrize(("call", "field"), [
    (lambda: rollout(prompt_ids=[]), "prompt_ids is empty"),
    (lambda: rollout(response_ids=[]), "response_ids is empty"),
    (lambda: rollout(prompt_ids=[1, -2]), r"prompt_ids\[1\] is a negative"),
    (lambda: rollout(response_ids=[-1, 2]), r"response_ids\[0\] is a negative"),
    (lambda: rollout(response_ids=[1, 2.0]), r"response_ids\[1\]"),
    (lambda: rollout(prompt_ids=[True]), r"prompt_ids\[0\]"),
    (lambda: rollout(response_mask=[1]), "response_mask has 1 entries for 2"),
    (lambda: rollout(response_mask=[1, 2]), r"response_mask\[1\] must be 0 or 1"),
    (lambda: rollout(response_mask=[1, 0.5]), r"response_mask\[1\] must be 0 or 1"),
    (lambda: rollout(old_logprobs=[-1.0]), "old_logprobs has 1 entries"),
    (lambda: rollout(reward=float("nan")), "reward"),
    (lambda: rollout(reward="1"), "reward"),
    (lambda: pack_padded([], 1, 1, 0), "rollouts is empty"),
    (lambda: pack_thd([], 1, 1, 0), "rollouts is empty"),
    (lambda: pack_padded([rollout()], 0, 1, 0), "tp"),
    (lambda: pack_thd([rollout()], 1, 0, 0), "cp"),
    (lambda: pack_thd([rollout()], 1, 1, 0, extra_multiple=0), "extra_multiple"),
    (lambda: pack_padded([rollout()], 1, 1, -1), "pad_id"),
    (lambda: pack_thd([rollout()], 1, 1, 1.0), "pad_id"),
    (lambda: pack_padded([rollout(old_logprobs=[-1.0, -1.0]), rollout()], 1, 1, 0),
     "old_logprobs given for 1 of 2"),
])
def test_bad_input_raises_value_error_naming_the_problem(call, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        call()


def test_batches_are_frozen() -> None:
    batch = pack_padded([rollout()], 1, 1, 0)
    assert isinstance(batch, PaddedBatch)
    assert isinstance(pack_thd([rollout()], 1, 1, 0), PackedBatch)
    with pytest.raises(AttributeError):
        batch.labels = batch.input_ids  # type: ignore[misc]
