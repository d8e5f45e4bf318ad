"""MTP loss: the RL loss mask rolled per depth (CPU). Rolled left by the depth, padded and
packed (THD, within each sequence by ``cu_seqlens``) alike, the mask never makes a prompt
token, or another sequence's token, an MTP target; ``roll_left`` zeroes the tail instead
of wrapping.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer_client.batch import Rollout, pack_padded, pack_thd
from trainer_client.roll import roll_left

# --------------------------------------------------------------------------- RL loss mask

@st.composite
def rollouts(draw: st.DrawFn) -> Rollout:
    num_prompt, num_response = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    tokens = st.integers(1, 99)
    return Rollout(prompt_ids=draw(st.lists(tokens, min_size=num_prompt, max_size=num_prompt)),
                   response_ids=draw(st.lists(tokens, min_size=num_response,
                                              max_size=num_response)),
                   response_mask=draw(st.none() | st.lists(st.integers(0, 1),
                                                           min_size=num_response,
                                                           max_size=num_response)))


def _trained_response_positions(rollout: Rollout) -> set[int]:
    """Indices into [prompt; response] of response tokens that carry loss."""
    mask = rollout.response_mask or [1] * len(rollout.response_ids)
    start = len(rollout.prompt_ids)
    return {start + i for i, m in enumerate(mask) if m}


@settings(max_examples=40, deadline=None)
@given(st.lists(rollouts(), min_size=1, max_size=4), st.integers(1, 4))
def test_rolled_response_mask_never_targets_a_prompt_token(batch: list[Rollout],
                                                           depth: int) -> None:
    padded = pack_padded(batch, tp=1, cp=1, pad_id=0)
    mask_k = roll_left(padded.loss_mask, depth)
    labels_k = roll_left(padded.labels, depth)
    for b, rollout in enumerate(batch):
        tokens = rollout.prompt_ids + rollout.response_ids
        trained = _trained_response_positions(rollout)
        for t in torch.nonzero(mask_k[b]).flatten().tolist():
            target = t + depth + 1  # position t at depth k predicts token t + k + 1
            assert target in trained, (b, t, depth)
            assert int(labels_k[b, t]) == tokens[target]

    # Packed (THD): rolled within each sequence, no sequence becomes another's target.
    packed = pack_thd(batch, tp=1, cp=1, pad_id=0)
    bounds = packed.cu_seqlens_padded
    mask_k = roll_left(packed.loss_mask, depth, cu_seqlens=bounds)
    labels_k = roll_left(packed.labels, depth, cu_seqlens=bounds)
    for i, rollout in enumerate(batch):
        start, end = int(bounds[i]), int(bounds[i + 1])
        tokens = rollout.prompt_ids + rollout.response_ids
        trained = _trained_response_positions(rollout)
        for t in torch.nonzero(mask_k[0, start:end]).flatten().tolist():
            assert t + depth + 1 in trained, (i, t, depth)
            assert int(labels_k[0, start + t]) == tokens[t + depth + 1]


def test_control_rolling_a_packed_row_whole_leaks_across_sequences() -> None:
    # Why cu_seqlens matters: without it the first sequence's last positions target the
    # second sequence's response.
    batch = [Rollout(prompt_ids=[5], response_ids=[6, 7]),
             Rollout(prompt_ids=[8], response_ids=[9, 10, 11])]
    packed = pack_thd(batch, tp=1, cp=1, pad_id=0)
    first_end = int(packed.cu_seqlens_padded[1])
    leaked = roll_left(packed.loss_mask, 2)[0, :first_end]
    kept = roll_left(packed.loss_mask, 2, cu_seqlens=packed.cu_seqlens_padded)[0, :first_end]
    assert leaked.sum() > kept.sum()


def test_roll_left_zeroes_the_tail_instead_of_wrapping() -> None:
    t = torch.arange(1, 6).view(1, 5)
    assert roll_left(t, 2).tolist() == [[3, 4, 5, 0, 0]]
    assert roll_left(t, 0).tolist() == t.tolist()
    assert roll_left(t, 9).tolist() == [[0] * 5]
    assert roll_left(t.T.contiguous(), 1, dim=0).flatten().tolist() == [2, 3, 4, 5, 0]
    assert roll_left(torch.arange(1, 8).view(1, 7), 1,
                     cu_seqlens=torch.tensor([0, 3, 3, 7])).tolist() == [[2, 3, 0, 5, 6, 7, 0]]
    with pytest.raises(ValueError, match="shifts"):
        roll_left(t, -1)
    with pytest.raises(ValueError, match="cu_seqlens"):
        roll_left(t, 1, cu_seqlens=torch.tensor([0, 4]))
