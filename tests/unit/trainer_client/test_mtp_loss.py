"""MTP loss: formula against a loop reference, gradient isolation, RL loss mask, autoscaler (CPU).

The last test builds a tiny megatron-core ``GPTModel`` with an MTP block in a spawned
process (megatron-core on CPU through ``trainer_client.megatron.cpu_compat``) and checks
the loss and the gradients against Megatron's own MTP path.
"""

from __future__ import annotations

import math
import multiprocessing
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.spawned import rendezvous_address, run_spawned
from trainer_client import mtp_autoscale, mtp_loss
from trainer_client.batch import Rollout, pack_padded, pack_thd
from trainer_client.mtp_loss import (
    MTPLossConfig,
    attach_mtp_loss,
    mtp_depth_losses,
    set_mtp_loss_backward_scale,
    total_mtp_loss,
)
from trainer_client.roll import roll_left

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


@st.composite
def problems(draw: st.DrawFn) -> dict:
    """A random MTP problem; float64 so the comparison can be tight."""
    num_depths = draw(st.integers(1, 3))
    batch, seq = draw(st.integers(1, 3)), draw(st.integers(1, 7))
    hidden_size, vocab = draw(st.integers(1, 5)), draw(st.integers(2, 9))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    mask_kind = draw(st.sampled_from(["binary", "weights", "zeros"]))
    if mask_kind == "binary":
        mask = torch.randint(0, 2, (batch, seq), generator=gen).double()
    elif mask_kind == "weights":
        mask = torch.rand(batch, seq, generator=gen, dtype=torch.float64)
    else:
        mask = torch.zeros(batch, seq, dtype=torch.float64)
    return {
        "hidden_bsh": [torch.randn(batch, seq, hidden_size, generator=gen, dtype=torch.float64)
                       for _ in range(num_depths)],
        "labels": torch.randint(0, vocab, (batch, seq), generator=gen),
        "mask": mask,
        "weight": torch.randn(vocab, hidden_size, generator=gen, dtype=torch.float64),
        "bias": (torch.randn(vocab, generator=gen, dtype=torch.float64)
                 if draw(st.booleans()) else None),
        "scaling_factor": draw(st.sampled_from([0.1, 0.3, 1.0])),
        "per_token": draw(st.booleans()),
        "layout": draw(st.sampled_from(["sbh", "bsh"])),
    }


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


# --------------------------------------------------------------------------- Megatron itself

def _gpt_model_worker(address: str, errors: multiprocessing.Queue) -> None:
    """In a fresh process: tiny GPTModel + 2 MTP layers on CPU; compare with Megatron."""
    try:
        _check_against_gpt_model(address)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent with its traceback
        import traceback
        errors.put(f"{exc!r}\n{traceback.format_exc()}")
        return
    errors.put(None)


def _check_against_gpt_model(address: str) -> None:
    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.transformer.multi_token_prediction import (
        MTPLossAutoScaler,
        MTPLossLoggingHelper,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    from trainer_client.megatron.cpu_compat import megatron_on_cpu

    dist.init_process_group("gloo", init_method=address, rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    assert mtp_autoscale._autoscaler() is MTPLossAutoScaler
    assert mtp_loss.megatron_has_process_mtp_loss() == hasattr(
        __import__("megatron.core.transformer.multi_token_prediction", fromlist=["x"]),
        "process_mtp_loss")

    num_depths, batch, seq, vocab, lam = 2, 2, 16, 96, 0.1

    def build(scaling_factor: float) -> GPTModel:
        torch.manual_seed(0)
        config = TransformerConfig(
            num_layers=1, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
            use_cpu_initialization=True, mtp_num_layers=num_depths,
            mtp_loss_scaling_factor=scaling_factor, hidden_dropout=0.0, attention_dropout=0.0)
        spec = get_gpt_layer_local_spec()
        return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab,
                        max_sequence_length=seq, position_embedding_type="rope",
                        mtp_block_spec=get_gpt_mtp_block_spec(config, spec,
                                                              use_transformer_engine=False),
                        share_embeddings_and_output_weights=False)

    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels = torch.cat([input_ids[:, 1:], torch.zeros(batch, 1, dtype=torch.long)], dim=1)
    loss_mask = torch.ones(batch, seq)
    loss_mask[:, :4] = 0.0  # a prompt
    loss_mask[:, -1] = 0.0
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1).view(1, 1, seq, seq)
    cfg = MTPLossConfig(num_layers=num_depths, scaling_factor=lam)

    def forward(model: GPTModel) -> tuple[torch.Tensor, list[torch.Tensor]]:
        captured = []
        handle = model.mtp.register_forward_hook(lambda _m, _i, out: captured.append(out))
        out = model(input_ids=input_ids, position_ids=torch.arange(seq).expand(batch, seq),
                    attention_mask=causal, labels=labels, loss_mask=loss_mask)
        handle.remove()
        # 0.16's MTP block returns [main; depth 1; ...; depth D] stacked on the sequence dim.
        return out, list(torch.chunk(captured[0], 1 + num_depths, dim=0)[1:])

    def grads(model: GPTModel) -> dict[str, torch.Tensor]:
        out = {n: (torch.zeros_like(p) if p.grad is None else p.grad.clone())
               for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return out

    with megatron_on_cpu():
        MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
        stock = build(lam)
        # 1. Megatron's own MTP path alone (main gradient zeroed): its logged L_k / N_k equal
        # ours, and it trains the output layer, which ours must not.
        MTPLossLoggingHelper.tracker.clear()
        out, hidden = forward(stock)
        logged = MTPLossLoggingHelper.tracker["values"].clone()
        (out * 0.0).sum().backward()
        grad_stock = grads(stock)
        assert torch.count_nonzero(grad_stock["output_layer.weight"]) > 0

        out, hidden = forward(stock)
        losses = mtp_depth_losses(hidden, labels, loss_mask, stock.output_layer.weight, None, cfg)
        for depth, value in zip(losses, logged):
            torch.testing.assert_close(depth.loss_sum / depth.num_tokens, value)
        total_mtp_loss(losses).backward()
        grad_ours = grads(stock)
        assert torch.count_nonzero(grad_ours["output_layer.weight"]) == 0
        mtp_names = [n for n in grad_ours if n.startswith("mtp.")]
        assert mtp_names
        for name in mtp_names:
            torch.testing.assert_close(grad_ours[name], grad_stock[name])
            assert torch.count_nonzero(grad_ours[name]) > 0 or name.endswith("bias")

        # 2. The 0.16 recipe: Megatron's own MTP loss scaled to 0, ours attached. The output
        # layer gets exactly the main loss's gradient; the MTP layers get s * ours.
        recipe = build(0.0)
        recipe.load_state_dict(stock.state_dict())

        def main_loss(per_token_ce: torch.Tensor) -> torch.Tensor:
            return (per_token_ce * loss_mask).sum() / loss_mask.sum()

        out, _ = forward(recipe)
        main_loss(out).backward()
        grad_main = grads(recipe)
        scale = 0.5
        set_mtp_loss_backward_scale(scale)
        out, hidden = forward(recipe)
        losses = mtp_depth_losses(hidden, labels, loss_mask, recipe.output_layer.weight, None, cfg)
        main_loss(attach_mtp_loss(out, total_mtp_loss(losses))).backward()
        grad_both = grads(recipe)
        MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
        assert torch.equal(grad_both["output_layer.weight"], grad_main["output_layer.weight"])
        for name in mtp_names:
            torch.testing.assert_close(grad_both[name], scale * grad_ours[name])
    dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="CPU-only (CPU-initialized model, 0.16's tracker key 'values'); "
                           "on CUDA test_gpu.py runs the same comparison through mtp_forward")
def test_against_megatron_gpt_model_with_mtp_block() -> None:
    pytest.importorskip("megatron.core")
    run_spawned(_gpt_model_worker, rendezvous_address(), timeout_s=240)
