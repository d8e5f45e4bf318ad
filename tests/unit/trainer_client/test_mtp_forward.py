"""``mtp_forward`` against megatron-core's own ``GPTModel`` forward and MTP loss.

The checks build the tiny MiMo config with two MTP layers through
``build_gpt_mtp_model``. :func:`check_mtp_forward_against_gpt_model` compares, on the
same weights and batch, with ``detach_trunk=False`` (Megatron's own MTP loss trains the
trunk):

- ``mtp_forward``'s main output with ``model(..., labels=...)``'s (bit-exact), and its MTP
  hidden states with the MTP block's output captured by a forward hook (bit-exact);
- our loss on those hidden states with what Megatron's own MTP path logs, and its
  gradients with Megatron's own MTP gradients everywhere except the output layer, which
  ours leaves at exactly zero;
- one combined backward (main loss + ours through ``attach_mtp_loss``): the output layer
  gets exactly the main loss's gradient, the rest main + s * ours.

:func:`check_mtp_only_grad` is slime's ``check_mtp_only_grad``: with ``detach_trunk`` (the
config's default) a backward of the MTP loss alone leaves every parameter outside the MTP
block at exactly zero gradient, without it the embedding's and the decoder's are not
zero; the MTP layers get the same gradient either way, and the main loss still trains
the trunk. :func:`check_bshd_recompute`: with activation recompute of the decoder and
MTP layers the losses and gradients equal those without.

The checks are device-agnostic: this file runs them on CPU with megatron-core 0.16 in a
spawned process; ``test_gpu.py`` runs them on CUDA (0.19 there).
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import warnings
from typing import Any

import pytest
import torch

from tests.support.spawned import rendezvous_address, run_spawned

BATCH, SEQ, NUM_DEPTHS = 2, 16, 2
RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform",
             "recompute_num_layers": 1}
"""Full activation recompute of every decoder layer and every MTP layer."""


def tiny_config(num_depths: int = NUM_DEPTHS) -> dict:
    """The embedded tiny checkpoint's config.json, with ``num_depths`` MTP layers."""
    from rollout_service.embedded.tiny_mimo import hf_config, model_size

    return {**hf_config(model_size("tiny")), "num_nextn_predict_layers": num_depths}


def batch(vocab: int, device: torch.device, seed: int = 1) -> dict[str, torch.Tensor]:
    """An RL-shaped batch: prompt and the last target masked out."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
    labels = torch.cat([input_ids[:, 1:], torch.zeros(BATCH, 1, dtype=torch.long)], dim=1)
    loss_mask = torch.ones(BATCH, SEQ)
    loss_mask[0, :4] = 0.0
    loss_mask[1, :6] = 0.0
    loss_mask[:, -1] = 0.0
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).view(1, 1, SEQ, SEQ)
    out = {"input_ids": input_ids, "position_ids": torch.arange(SEQ).expand(BATCH, SEQ),
           "attention_mask": causal, "labels": labels, "loss_mask": loss_mask}
    return {name: t.to(device) for name, t in out.items()}


def logged_mtp_losses() -> torch.Tensor:
    """Megatron's tracker of per-depth ``L_k / N_k`` (key ``values`` on 0.16,
    ``loss_values`` from 0.19 on)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    for key in ("values", "loss_values"):
        if key in tracker:
            return tracker[key].clone()
    raise KeyError(f"MTPLossLoggingHelper.tracker has none of the known keys: {list(tracker)}")


def masked_mean(per_token: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    return (per_token * loss_mask).sum() / loss_mask.sum()


def check_mtp_forward_against_gpt_model(device: torch.device) -> None:
    """The comparisons of the module docstring; parallel_state must be up (TP 1)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from trainer_client.megatron.model import build_gpt_mtp_model
    from trainer_client.megatron.mtp_forward import mtp_forward
    from trainer_client.mtp_loss import (
        MTPLossConfig,
        attach_mtp_loss,
        mtp_depth_losses,
        set_mtp_loss_backward_scale,
        total_mtp_loss,
    )

    config = tiny_config()
    torch.manual_seed(0)
    model = build_gpt_mtp_model(config).to(device)
    lam = model.config.mtp_loss_scaling_factor  # Megatron's stock path uses it; we match it
    cfg = MTPLossConfig(num_layers=NUM_DEPTHS, scaling_factor=lam)
    data = batch(config["vocab_size"], device)
    labels, loss_mask = data["labels"], data["loss_mask"]

    def grads() -> dict[str, torch.Tensor]:
        out = {n: (torch.zeros_like(p) if p.grad is None else p.grad.clone())
               for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return out

    def ours(hidden: list[torch.Tensor], weight: torch.Tensor) -> list:
        return mtp_depth_losses(hidden, labels, loss_mask, weight, None, cfg)

    set_mtp_loss_backward_scale(1.0)
    # 1. Megatron's stock forward: MTP loss inline (0.16) or process_mtp_loss (0.17+).
    MTPLossLoggingHelper.tracker.clear()
    captured = []
    handle = model.mtp.register_forward_hook(lambda _m, _i, out: captured.append(out))
    stock_out = model(**data)
    handle.remove()
    stock_hidden = list(torch.chunk(captured[0], 1 + NUM_DEPTHS, dim=0)[1:])
    logged = logged_mtp_losses()
    (stock_out * 0.0).sum().backward()  # Megatron's MTP gradient alone
    grad_stock = grads()
    assert torch.count_nonzero(grad_stock["output_layer.weight"]) > 0  # stock trains the head

    # 2. mtp_forward: same main output and hidden states, and Megatron logs nothing.
    out = mtp_forward(model, **data, detach_trunk=False)
    assert len(out.mtp_hidden) == NUM_DEPTHS
    assert out.output_weight is model.output_layer.weight
    assert torch.equal(out.main_output, stock_out.detach())
    for got, want in zip(out.mtp_hidden, stock_hidden, strict=True):
        assert got.shape == (SEQ, BATCH, config["hidden_size"])
        assert torch.equal(got, want.detach())
    assert torch.equal(logged_mtp_losses(), logged), "Megatron's MTP loss ran in mtp_forward"

    losses = ours(out.mtp_hidden, out.output_weight)
    reference = ours([h.detach() for h in stock_hidden], model.output_layer.weight)
    for depth, ref, value in zip(losses, reference, logged, strict=True):
        assert torch.equal(depth.loss_sum.detach(), ref.loss_sum)
        torch.testing.assert_close(depth.loss_sum / depth.num_tokens, value)
    total_mtp_loss(losses).backward()
    grad_ours = grads()
    assert torch.count_nonzero(grad_ours["output_layer.weight"]) == 0
    mtp_names = [n for n in grad_ours if n.startswith("mtp.")]
    assert mtp_names
    for name, grad in grad_ours.items():
        if name != "output_layer.weight":  # same loss, same scale: same gradient elsewhere
            torch.testing.assert_close(grad, grad_stock[name], rtol=1e-4, atol=1e-6)
    for name in mtp_names:
        assert torch.count_nonzero(grad_ours[name]) > 0, name

    # 3. Main loss + ours attached, backward scale s.
    masked_mean(mtp_forward(model, **data, detach_trunk=False).main_output,
                loss_mask).backward()
    grad_main = grads()
    scale = 0.5
    set_mtp_loss_backward_scale(scale)
    try:
        out = mtp_forward(model, **data, detach_trunk=False)
        total = total_mtp_loss(ours(out.mtp_hidden, out.output_weight))
        loss = masked_mean(attach_mtp_loss(out.main_output, total), loss_mask)
        assert torch.isfinite(loss) and torch.isfinite(total)
        loss.backward()
    finally:
        set_mtp_loss_backward_scale(1.0)
    grad_both = grads()
    assert torch.equal(grad_both["output_layer.weight"], grad_main["output_layer.weight"])
    for name, grad in grad_both.items():
        torch.testing.assert_close(grad, grad_main[name] + scale * grad_ours[name],
                                   rtol=1e-4, atol=1e-6)
    for name in mtp_names:
        assert torch.count_nonzero(grad_both[name]) > 0, name


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient (zeros where None), then the gradients are cleared."""
    out = {n: (torch.zeros_like(p) if p.grad is None else p.grad.clone())
           for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def check_mtp_only_grad(device: torch.device) -> dict[str, float]:
    """The detach_trunk check of the module docstring; parallel_state must be up (TP 1).

    Returns the summed gradient norms the MTP loss alone gives the embedding and the
    decoder layers with ``detach_trunk=False`` (0 with it, exactly)."""
    from trainer_client.megatron.model import build_gpt_mtp_model
    from trainer_client.megatron.mtp_forward import mtp_forward
    from trainer_client.mtp_loss import (
        MTPLossConfig,
        attach_mtp_loss,
        mtp_depth_losses,
        set_mtp_loss_backward_scale,
        total_mtp_loss,
    )

    config = tiny_config()
    torch.manual_seed(0)
    model = build_gpt_mtp_model(config).to(device)
    data = batch(config["vocab_size"], device)
    cfg = MTPLossConfig(num_layers=NUM_DEPTHS)
    assert cfg.detach_trunk, "the default the RL loop runs with"
    set_mtp_loss_backward_scale(1.0)

    def mtp_loss(detach_trunk: bool) -> tuple[Any, torch.Tensor]:
        out = mtp_forward(model, **data, detach_trunk=detach_trunk)
        return out, total_mtp_loss(mtp_depth_losses(out.mtp_hidden, data["labels"],
                                                    data["loss_mask"], out.output_weight,
                                                    None, cfg))

    mtp_loss(True)[1].backward()
    cut = grads_of(model)
    mtp_loss(False)[1].backward()
    live = grads_of(model)
    mtp_names = [n for n in cut if n.startswith("mtp.")]
    trunk_names = [n for n in cut if not n.startswith("mtp.")]
    decoder_names = [n for n in trunk_names if n.startswith("decoder.layers.")]
    assert mtp_names and decoder_names and "embedding.word_embeddings.weight" in trunk_names
    for name in trunk_names:  # embedding, decoder, final norm, output layer
        assert torch.count_nonzero(cut[name]) == 0, f"{name}: MTP gradient with detach_trunk"
    assert torch.count_nonzero(live["output_layer.weight"]) == 0  # detached either way
    assert torch.count_nonzero(live["embedding.word_embeddings.weight"]) > 0
    for name in decoder_names:
        assert torch.count_nonzero(live[name]) > 0, f"{name}: no MTP gradient without the cut"
    for name in mtp_names:
        assert torch.count_nonzero(cut[name]) > 0, name
        torch.testing.assert_close(cut[name], live[name], rtol=1e-5, atol=1e-7)

    # The main loss still trains the trunk: main + MTP (attached) under the cut gives the
    # trunk exactly the main loss's gradient.
    out, _ = mtp_loss(True)
    masked_mean(out.main_output, data["loss_mask"]).backward()
    main_only = grads_of(model)
    out, total = mtp_loss(True)
    masked_mean(attach_mtp_loss(out.main_output, total), data["loss_mask"]).backward()
    both = grads_of(model)
    for name in trunk_names:
        assert torch.equal(both[name], main_only[name]), name
        assert name.startswith("output_layer.") or torch.count_nonzero(both[name]) > 0, name
    for name in mtp_names:
        torch.testing.assert_close(both[name], cut[name], rtol=1e-5, atol=1e-7)
    return {"embedding": float(live["embedding.word_embeddings.weight"].norm()),
            "decoder_layers": sum(float(live[n].norm()) for n in decoder_names)}


def losses_and_grads(model: torch.nn.Module, args: tuple, cfg: object, *, detach_trunk: bool,
                     cu_seqlens: torch.Tensor | None = None) -> dict[str, object]:
    """One training backward (masked main loss + our MTP loss attached) of ``mtp_forward(
    model, *args)``: the loss, each depth's loss sum and every parameter's gradient."""
    from trainer_client.megatron.mtp_forward import mtp_forward
    from trainer_client.mtp_loss import attach_mtp_loss, mtp_depth_losses, total_mtp_loss

    labels, loss_mask = args[3], args[4]
    model.zero_grad(set_to_none=True)
    out = mtp_forward(model, *args, detach_trunk=detach_trunk)
    depths = mtp_depth_losses(out.mtp_hidden, labels, loss_mask, out.output_weight, None, cfg,
                              cu_seqlens=cu_seqlens)
    loss = masked_mean(attach_mtp_loss(out.main_output, total_mtp_loss(depths)), loss_mask)
    loss.backward()
    return {"loss": loss.detach(), "mtp": [d.loss_sum.detach() for d in depths],
            "grads": grads_of(model), "recomputed": _graph_has(out.mtp_hidden[0],
                                                               "CheckpointFunction")}


def _graph_has(tensor: torch.Tensor, node_name: str) -> bool:
    """Whether ``tensor``'s autograd graph holds a node whose name contains ``node_name``."""
    seen, todo = set(), [tensor.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node_name in type(node).__name__:
            return True
        todo += [next_node for next_node, _ in node.next_functions]
    return False


def check_bshd_recompute(device: torch.device) -> None:
    """Recompute (:data:`RECOMPUTE`) vs none, same weights and padded batch, with and
    without ``detach_trunk``: same losses and gradients, the MTP layers' included."""
    from trainer_client.megatron.model import build_gpt_mtp_model
    from trainer_client.mtp_loss import MTPLossConfig, set_mtp_loss_backward_scale

    config = tiny_config()
    torch.manual_seed(0)
    plain = build_gpt_mtp_model(config).to(device)
    recomputed = build_gpt_mtp_model(config, transformer_config=RECOMPUTE).to(device)
    recomputed.load_state_dict(plain.state_dict())
    data = batch(config["vocab_size"], device)
    args = (data["input_ids"], data["position_ids"], data["attention_mask"], data["labels"],
            data["loss_mask"])
    cfg = MTPLossConfig(num_layers=NUM_DEPTHS)
    set_mtp_loss_backward_scale(1.0)
    for detach_trunk in (True, False):
        want = losses_and_grads(plain, args, cfg, detach_trunk=detach_trunk)
        got = losses_and_grads(recomputed, args, cfg, detach_trunk=detach_trunk)
        assert got.pop("recomputed") and not want.pop("recomputed"), "MTP layer not recomputed"
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        for name, grad in got["grads"].items():
            if name.startswith("mtp."):
                assert torch.count_nonzero(grad) > 0, (detach_trunk, name)


def test_a_module_without_an_mtp_block_is_refused() -> None:
    from trainer_client.megatron.mtp_forward import mtp_forward

    ids = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(RuntimeError, match=r"lacks \['decoder'"):
        mtp_forward(torch.nn.Linear(2, 2), ids, ids, None, None, None, detach_trunk=True)


# --------------------------------------------------------------------------- CPU process

def _worker(checks: list, address: str, errors: multiprocessing.Queue) -> None:
    try:
        warnings.filterwarnings("ignore")
        torch.set_num_threads(2)
        from trainer_client.megatron.model import init_parallel_cpu

        with init_parallel_cpu(init_method=address):
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            for check in checks:
                check(device)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent with its traceback
        import traceback
        errors.put(f"{exc!r}\n{traceback.format_exc()}")
        return
    errors.put(None)


def _check_logits_and_errors(device: torch.device) -> None:
    """labels=None gives GPTModel's logits (0.16's own forward crashes there); a stage
    without the output layer is refused."""
    from trainer_client.megatron.model import build_gpt_mtp_model
    from trainer_client.megatron.mtp_forward import mtp_forward

    config = tiny_config()
    torch.manual_seed(0)
    model = build_gpt_mtp_model(config).to(device)
    data = batch(config["vocab_size"], device)
    data["labels"] = None
    with torch.no_grad():
        out = mtp_forward(model, **data, detach_trunk=True)
        logits, _ = model.output_layer(out.mtp_hidden[0][:, :1])
    assert out.main_output.shape == (BATCH, SEQ, config["vocab_size"])
    assert torch.isfinite(out.main_output).all() and torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="detach_trunk must be a bool"):
        mtp_forward(model, **data, detach_trunk=None)
    model.post_process = False
    with pytest.raises(ValueError, match="no output layer"):
        mtp_forward(model, **data, detach_trunk=True)
    with pytest.raises(ValueError, match=r"transformer_config: \['hidden_size'\]"):
        build_gpt_mtp_model(config, transformer_config={"hidden_size": 8})
    if importlib.util.find_spec("transformer_engine") is None:
        with pytest.raises(RuntimeError, match="needs Transformer Engine"):
            build_gpt_mtp_model(config, use_transformer_engine=True)


def test_mtp_forward_matches_gpt_model_in_a_megatron_process() -> None:
    pytest.importorskip("megatron.core")
    run_spawned(_worker, [check_mtp_forward_against_gpt_model, _check_logits_and_errors],
                rendezvous_address(), timeout_s=300)


def test_detach_trunk_leaves_every_non_mtp_gradient_exactly_zero() -> None:
    pytest.importorskip("megatron.core")
    run_spawned(_worker, [check_mtp_only_grad], rendezvous_address(), timeout_s=300)


def test_recompute_of_decoder_and_mtp_layers_matches_no_recompute() -> None:
    pytest.importorskip("megatron.core")
    run_spawned(_worker, [check_bshd_recompute], rendezvous_address(), timeout_s=300)
