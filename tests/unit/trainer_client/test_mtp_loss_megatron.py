"""MTP loss against Megatron's own MTP path (CPU).

The test builds a tiny megatron-core ``GPTModel`` with an MTP block in a spawned
process (megatron-core on CPU through ``trainer_client.megatron.cpu_compat``) and checks
the loss and the gradients against Megatron's own MTP path.
"""

from __future__ import annotations

import multiprocessing
import warnings

import pytest
import torch

from tests.support.spawned import rendezvous_address, run_spawned
from trainer_client import mtp_autoscale, mtp_loss
from trainer_client.mtp_loss import (
    MTPLossConfig,
    attach_mtp_loss,
    mtp_depth_losses,
    set_mtp_loss_backward_scale,
    total_mtp_loss,
)

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
