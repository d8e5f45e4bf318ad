"""MTP loss: the formula against a loop reference, per-token scaling, a depth with no
target left, and the config's and inputs' refusals (CPU).

The reference is written from megatron-core's definition, not from the code under test;
the random problems come from ``tests/support/mtp_problems.py``. Gradients are
``test_mtp_loss_gradients.py``, the RL loss mask ``test_mtp_loss_mask.py``, Megatron's
own MTP path ``test_mtp_loss_megatron.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings

from tests.support.mtp_problems import problems
from trainer_client.mtp_loss import MTPLossConfig, mtp_depth_losses, total_mtp_loss

# --------------------------------------------------------------------------- reference

def reference_losses(hidden_bsh: list[torch.Tensor], labels: torch.Tensor, mask: torch.Tensor,
                     weight: torch.Tensor, bias: torch.Tensor | None, scaling_factor: float,
                     per_token: bool) -> list[tuple[float, float, float]]:
    """(L_k, N_k, scaled_k) per depth, one token at a time, in float64 Python arithmetic.

    Written from megatron-core's definition, not from the code under test: the target of
    position t at depth k is the label at t + k (nothing past the end), weighted by the
    mask at t + k.
    """
    num_depths = len(hidden_bsh)
    batch, seq = labels.shape
    w = weight.double()
    b = torch.zeros(w.size(0), dtype=torch.float64) if bias is None else bias.double()
    num_main = sum(float(mask[i, t]) for i in range(batch) for t in range(seq))
    out = []
    for k in range(1, num_depths + 1):
        loss_sum, num_tokens = 0.0, 0.0
        for i in range(batch):
            for t in range(seq):
                src = t + k
                if src >= seq:
                    continue
                weight_t = float(mask[i, src])
                num_tokens += weight_t
                if weight_t == 0.0:
                    continue
                logits = [float(x) for x in w @ hidden_bsh[k - 1][i, t].double() + b]
                top = max(logits)
                log_z = top + math.log(sum(math.exp(x - top) for x in logits))
                loss_sum += weight_t * (log_z - logits[int(labels[i, src])])
        scale = scaling_factor / num_depths
        denom = max(num_tokens, 1.0)
        scaled = scale * loss_sum * num_main / denom if per_token else scale * loss_sum / denom
        out.append((loss_sum, num_tokens, scaled))
    return out


@settings(max_examples=25, deadline=None)
@given(problems())
def test_losses_equal_the_loop_reference(p: dict) -> None:
    cfg = MTPLossConfig(num_layers=len(p["hidden_bsh"]), scaling_factor=p["scaling_factor"],
                        per_token=p["per_token"])
    hidden = [h.transpose(0, 1) if p["layout"] == "sbh" else h for h in p["hidden_bsh"]]
    got = mtp_depth_losses(hidden, p["labels"], p["mask"], p["weight"], p["bias"], cfg,
                           hidden_layout=p["layout"])
    want = reference_losses(p["hidden_bsh"], p["labels"], p["mask"], p["weight"], p["bias"],
                            p["scaling_factor"], p["per_token"])
    assert [d.depth for d in got] == list(range(1, cfg.num_layers + 1))
    for depth, (loss_sum, num_tokens, scaled) in zip(got, want):
        assert float(depth.loss_sum) == pytest.approx(loss_sum, rel=1e-9, abs=1e-9)
        assert float(depth.num_tokens) == pytest.approx(num_tokens, rel=1e-12, abs=1e-12)
        assert float(depth.scaled_loss) == pytest.approx(scaled, rel=1e-9, abs=1e-9)
    assert float(total_mtp_loss(got)) == pytest.approx(sum(w[2] for w in want), rel=1e-9,
                                                       abs=1e-9)


def test_per_token_mode_scales_by_n0_over_nk() -> None:
    gen = torch.Generator().manual_seed(3)
    hidden = [torch.randn(6, 2, 4, generator=gen) for _ in range(2)]
    labels = torch.randint(0, 5, (2, 6), generator=gen)
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]], dtype=torch.float32)
    weight = torch.randn(5, 4, generator=gen)
    mean = mtp_depth_losses(hidden, labels, mask, weight, None, MTPLossConfig(num_layers=2))
    token = mtp_depth_losses(hidden, labels, mask, weight, None,
                             MTPLossConfig(num_layers=2, per_token=True))
    for m, t in zip(mean, token):
        # N_0 = 8; depth 1 keeps 8 tokens, depth 2 keeps 7.
        loss_sum, num_tokens = float(m.loss_sum), float(m.num_tokens)
        assert float(m.scaled_loss) == pytest.approx(0.1 / 2 * loss_sum / num_tokens)
        assert float(t.scaled_loss) == pytest.approx(0.1 / 2 * loss_sum * 8 / num_tokens)
    assert [float(m.num_tokens) for m in mean] == [8.0, 7.0]


@pytest.mark.parametrize("per_token", [False, True])
def test_a_depth_with_no_target_left_is_finite(per_token: bool) -> None:
    # Only position 1 is a target: after one roll it sits at 0, after two it is gone.
    mask = torch.tensor([[0.0, 1.0, 0.0, 0.0]])
    hidden = [torch.randn(4, 1, 3, requires_grad=True) for _ in range(3)]
    weight = torch.randn(6, 3)
    losses = mtp_depth_losses(hidden, torch.tensor([[1, 2, 3, 4]]), mask, weight, None,
                              MTPLossConfig(num_layers=3, per_token=per_token))
    assert [float(d.num_tokens) for d in losses] == [1.0, 0.0, 0.0]
    for depth in losses:
        assert torch.isfinite(depth.scaled_loss)
    assert losses[1].scaled_loss.item() == 0.0 and losses[2].scaled_loss.item() == 0.0
    total_mtp_loss(losses).backward()
    assert all(torch.isfinite(h.grad).all() for h in hidden)
    assert torch.count_nonzero(hidden[1].grad) == 0  # nothing to learn at depth 2


def test_config_refuses_bad_values_naming_the_field() -> None:
    for kwargs, field in [({"num_layers": 0}, "num_layers"), ({"num_layers": True}, "num_layers"),
                          ({"num_layers": 1, "scaling_factor": -0.1}, "scaling_factor"),
                          ({"num_layers": 1, "scaling_factor": float("nan")}, "scaling_factor"),
                          ({"num_layers": 1, "per_token": 1}, "per_token"),
                          ({"num_layers": 1, "detach_trunk": None}, "detach_trunk")]:
        with pytest.raises(ValueError, match=field):
            MTPLossConfig(**kwargs)
    cfg = MTPLossConfig(num_layers=2)
    with pytest.raises(ValueError, match="hidden_per_depth"):
        mtp_depth_losses([torch.zeros(3, 1, 2)], torch.zeros(1, 3, dtype=torch.long),
                         torch.ones(1, 3), torch.zeros(4, 2), None, cfg)
    with pytest.raises(ValueError, match=r"hidden_per_depth\[1\]"):
        mtp_depth_losses([torch.zeros(3, 1, 2), torch.zeros(1, 3, 2)],
                         torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3),
                         torch.zeros(4, 2), None, cfg)
    with pytest.raises(ValueError, match="output_bias"):
        mtp_depth_losses([torch.zeros(3, 1, 2)] * 2, torch.zeros(1, 3, dtype=torch.long),
                         torch.ones(1, 3), torch.zeros(4, 2), torch.zeros(3), cfg)
