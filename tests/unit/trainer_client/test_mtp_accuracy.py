"""The MTP head's top-1 agreement: against a loop reference, mask-aware, under vocabulary
parallelism (two gloo ranks), and reduced for logging (CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings

from tests.support.mtp_problems import problems
from tests.support.spawned import rendezvous_address, run_ranks
from trainer_client.mtp_loss import (
    MTPLossConfig,
    _top1_vocab_parallel,
    mtp_depth_losses,
    reduce_for_logging,
)


def reference_correct(hidden_bsh: list[torch.Tensor], labels: torch.Tensor, mask: torch.Tensor,
                      weight: torch.Tensor, bias: torch.Tensor | None) -> list[float]:
    """Per depth k: sum over positions t of mask[t + k] * [argmax logits(t) == label[t + k]],
    one position at a time (written from the definition, not from the code under test)."""
    batch, seq = labels.shape
    b = torch.zeros(weight.size(0), dtype=weight.dtype) if bias is None else bias
    out = []
    for k, hidden in enumerate(hidden_bsh, start=1):
        correct = 0.0
        for i in range(batch):
            for t in range(seq - k):
                top = int(torch.argmax(weight @ hidden[i, t] + b))
                correct += float(mask[i, t + k]) * (top == int(labels[i, t + k]))
        out.append(correct)
    return out


@settings(max_examples=25, deadline=None)
@given(problems())
def test_top1_agreement_equals_the_loop_reference(p: dict) -> None:
    cfg = MTPLossConfig(num_layers=len(p["hidden_bsh"]))
    hidden = [h.transpose(0, 1) if p["layout"] == "sbh" else h for h in p["hidden_bsh"]]
    got = mtp_depth_losses(hidden, p["labels"], p["mask"], p["weight"], p["bias"], cfg,
                           hidden_layout=p["layout"])
    want = reference_correct(p["hidden_bsh"], p["labels"], p["mask"], p["weight"], p["bias"])
    assert [float(d.num_correct) for d in got] == pytest.approx(want, abs=1e-9)
    assert all(d.num_correct.grad_fn is None for d in got)


def test_a_head_that_predicts_the_labels_scores_one_where_the_mask_is_on() -> None:
    vocab, seq = 6, 8
    labels = torch.tensor([[1, 2, 3, 4, 5, 0, 1, 2]])
    # hidden at t is the one-hot of the token two ahead; an identity head reads it back
    hidden = torch.zeros(1, seq, vocab, dtype=torch.float64)
    for t in range(seq - 1):
        hidden[0, t, labels[0, t + 1]] = 1.0
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 0]], dtype=torch.float64)
    (depth,) = mtp_depth_losses([hidden], labels, mask, torch.eye(vocab, dtype=torch.float64),
                                None, MTPLossConfig(num_layers=1), hidden_layout="bsh")
    assert float(depth.num_correct) == float(depth.num_tokens) == 4.0  # prompt never counts
    wrong = mtp_depth_losses([hidden.roll(1, dims=2)], labels, mask,
                             torch.eye(vocab, dtype=torch.float64), None,
                             MTPLossConfig(num_layers=1), hidden_layout="bsh")[0]
    assert float(wrong.num_correct) == 0.0
    logged = reduce_for_logging([depth], groups=[], is_source_rank=True)
    assert logged is not None and logged["mtp_1_accuracy"] == 1.0


def _top1_on_shards(rank: int, address: str) -> bool:
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=2)
    try:
        gen = torch.Generator().manual_seed(3)
        logits = torch.randint(-3, 3, (4, 16, 10), generator=gen).double()  # many ties
        shard = logits[..., 5 * rank:5 * (rank + 1)]
        got = _top1_vocab_parallel(shard.clone(), dist.group.WORLD)
        return bool(torch.equal(got, logits.argmax(dim=-1)))
    finally:
        dist.destroy_process_group()


def test_top1_over_vocabulary_shards_is_the_full_argmax_ties_included() -> None:
    assert run_ranks(_top1_on_shards, 2, rendezvous_address(), timeout_s=120) == {0: True, 1: True}
