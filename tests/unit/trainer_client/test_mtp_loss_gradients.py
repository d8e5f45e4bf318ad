"""MTP loss: gradient isolation and the autoscaler (CPU). The MTP loss trains the MTP
layers and the trunk, never the shared output layer (a control test shows the isolation
can fail); the bias stays in the logits; the trunk is detached by default;
``attach_mtp_loss`` adds the scaled MTP gradient to the main loss's, leaving the output
layer the main loss's gradient alone.

A plain-torch stand-in (``TinyMTP``) plays the MTP layers and the shared lm_head; the
autoscaler is the fallback written here, so this process never imports megatron-core
(Megatron's own is ``test_mtp_loss_megatron.py``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainer_client import mtp_autoscale, mtp_loss
from trainer_client.mtp_loss import (
    MTPLossConfig,
    attach_mtp_loss,
    mtp_depth_losses,
    set_mtp_loss_backward_scale,
    total_mtp_loss,
)

# --------------------------------------------------------------------------- gradients

class TinyMTP(torch.nn.Module):
    """Stand-in for the MTP layers + the shared lm_head (plain torch; shapes only)."""

    def __init__(self, *, hidden_size: int, vocab: int, num_depths: int, bias: bool) -> None:
        super().__init__()
        self.mtp_layers = torch.nn.ModuleList(torch.nn.Linear(hidden_size, hidden_size)
                                              for _ in range(num_depths))
        self.lm_head = torch.nn.Linear(hidden_size, vocab, bias=bias)

    def mtp_hidden(self, trunk: torch.Tensor) -> list[torch.Tensor]:
        out, h = [], trunk
        for layer in self.mtp_layers:
            h = torch.tanh(layer(h))
            out.append(h)
        return out


def _problem(seed: int = 0, *, seq: int = 7, batch: int = 2, hidden_size: int = 4,
             vocab: int = 9) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    trunk = torch.randn(seq, batch, hidden_size, generator=gen)
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq)
    mask[:, :2] = 0.0
    return trunk, labels, mask


@pytest.mark.parametrize("bias", [False, True])
def test_mtp_loss_alone_leaves_the_output_layer_untouched(bias: bool) -> None:
    torch.manual_seed(0)
    model = TinyMTP(hidden_size=4, vocab=9, num_depths=2, bias=bias)
    trunk, labels, mask = _problem()
    trunk.requires_grad_(True)
    hidden = model.mtp_hidden(trunk)
    for h in hidden:
        h.retain_grad()
    lm = model.lm_head
    losses = mtp_depth_losses(hidden, labels, mask, lm.weight, lm.bias,
                              MTPLossConfig(num_layers=2))
    total_mtp_loss(losses).backward()
    assert lm.weight.grad is None or torch.count_nonzero(lm.weight.grad) == 0
    if bias:
        assert lm.bias.grad is None or torch.count_nonzero(lm.bias.grad) == 0
    for h in hidden:
        assert torch.count_nonzero(h.grad) > 0
    for layer in model.mtp_layers:
        assert torch.count_nonzero(layer.weight.grad) > 0
    assert torch.count_nonzero(trunk.grad) > 0


@pytest.mark.parametrize("bias", [False, True])
def test_bias_is_kept_in_the_logits(bias: bool) -> None:
    # Dropping the bias (verl) changes the loss: with it, the value matches F.linear + CE.
    torch.manual_seed(1)
    model = TinyMTP(hidden_size=4, vocab=9, num_depths=1, bias=True)
    with torch.no_grad():
        model.lm_head.bias.normal_(0.0, 3.0)
    trunk, labels, mask = _problem(1)
    (hidden,) = model.mtp_hidden(trunk)
    lm = model.lm_head
    (got,) = mtp_depth_losses([hidden], labels, mask, lm.weight, lm.bias if bias else None,
                              MTPLossConfig(num_layers=1))
    logits = F.linear(hidden.transpose(0, 1), lm.weight, lm.bias if bias else None)
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, 9), labels[:, 1:].reshape(-1),
                         reduction="none")
    assert got.loss_sum.item() == pytest.approx((ce * mask[:, 1:].reshape(-1)).sum().item(),
                                                rel=1e-5)


def test_control_attached_output_layer_does_reach_the_lm_head(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The isolation test above can fail: with the parameters attached, they get a gradient.
    import trainer_client.mtp_loss

    monkeypatch.setattr(trainer_client.mtp_loss, "isolated_output_layer",
                        lambda weight, bias: (weight, bias))
    torch.manual_seed(0)
    model = TinyMTP(hidden_size=4, vocab=9, num_depths=2, bias=True)
    trunk, labels, mask = _problem()
    lm = model.lm_head
    losses = mtp_depth_losses(model.mtp_hidden(trunk), labels, mask, lm.weight, lm.bias,
                              MTPLossConfig(num_layers=2))
    total_mtp_loss(losses).backward()
    assert torch.count_nonzero(lm.weight.grad) > 0 and torch.count_nonzero(lm.bias.grad) > 0


def test_detach_trunk_is_on_by_default_and_the_old_switch_is_gone() -> None:
    # Applied by megatron.mtp_forward (test_mtp_forward.check_mtp_only_grad); the
    # never-applied detach_embedding switch is gone, so a config naming it fails loudly.
    assert MTPLossConfig(num_layers=1).detach_trunk is True
    assert MTPLossConfig(num_layers=1, detach_trunk=False).detach_trunk is False
    with pytest.raises(TypeError, match="detach_embedding"):
        MTPLossConfig(num_layers=1, detach_embedding=True)  # type: ignore[call-arg]



# --------------------------------------------------------------------------- autoscaler

@pytest.fixture
def fallback_autoscaler(monkeypatch: pytest.MonkeyPatch) -> None:
    """The autoscaler written here (used without megatron-core); Megatron's is tested in
    the GPTModel process below. Keeps this process free of the megatron import."""
    monkeypatch.setattr(mtp_autoscale, "_autoscaler", lambda: mtp_autoscale._MTPLossAutoScaler)
    monkeypatch.setattr(mtp_autoscale._MTPLossAutoScaler, "main_loss_backward_scale",
                        torch.tensor(1.0))


@pytest.mark.usefixtures("fallback_autoscaler")
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_attach_mtp_loss_adds_the_scaled_mtp_gradient(scale: float) -> None:
    torch.manual_seed(0)
    model = TinyMTP(hidden_size=4, vocab=9, num_depths=2, bias=True)
    trunk, labels, mask = _problem()

    def main_loss(hidden_main: torch.Tensor) -> torch.Tensor:
        logits = model.lm_head(hidden_main.transpose(0, 1))
        ce = F.cross_entropy(logits.reshape(-1, 9), labels.reshape(-1), reduction="none")
        return (ce * mask.reshape(-1)).sum() / mask.sum()

    def grads() -> dict[str, torch.Tensor]:
        out = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
               for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return out

    def mtp_total() -> torch.Tensor:
        lm = model.lm_head
        return total_mtp_loss(mtp_depth_losses(model.mtp_hidden(trunk), labels, mask, lm.weight,
                                               lm.bias, MTPLossConfig(num_layers=2)))

    main_loss(trunk).backward()
    grad_main = grads()
    mtp_total().backward()
    grad_mtp = grads()

    set_mtp_loss_backward_scale(scale)
    assert float(mtp_loss.get_mtp_loss_backward_scale()) == scale
    attached = attach_mtp_loss(trunk, mtp_total())
    assert torch.equal(attached, trunk)
    main_loss(attached).backward()
    grad_both = grads()
    for name, grad in grad_both.items():
        torch.testing.assert_close(grad, grad_main[name] + scale * grad_mtp[name])
        if name.startswith("mtp_layers."):
            assert torch.count_nonzero(grad) > 0
    # The lm_head got the main loss's gradient and nothing else.
    for name in ("lm_head.weight", "lm_head.bias"):
        assert torch.equal(grad_both[name], grad_main[name])

