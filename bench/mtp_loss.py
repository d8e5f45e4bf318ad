"""Cost of the MTP loss in a training step, and padding overhead of the CP/TP rule.

Runs on one CUDA GPU (the project's H200; megatron-core, local spec, no Transformer
Engine) in one process with a world of one. Three models of the same shape, each
timed over the same batches after a warm-up (forward + backward + Adam step, CUDA
synchronized), peak memory from ``torch.cuda.max_memory_allocated``:

- ``off``: the GPTModel without an MTP block (main loss only);
- ``megatron``: with one MTP layer and Megatron's own MTP loss (``labels`` given);
- ``ours``: the same model through ``mtp_forward`` + ``mtp_depth_losses`` (output
  layer detached) + ``attach_mtp_loss``.

Target: ``ours`` adds no more than 5 % step time over ``megatron``. The second table
(CPU only, no GPU needed, a few seconds) compares padded tokens / real tokens of packed
(THD) rows on a log-normal length distribution, 8 sequences per row: this project's rule
(each sequence to ``2*cp``, the row's total to ``lcm(2*cp, cp*tp)``), its rule before
(each sequence to ``lcm(2*cp, cp*tp)``) and verl's (each sequence to ``tp*cp*2``).

    python -m bench.mtp_loss                 # both tables (the first needs CUDA)
    python -m bench.mtp_loss --padding-only
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.padding_rules import padding_overhead
from rollout_service.tools.launch import free_port

HF_CONFIG: dict[str, Any] = {
    "architectures": ["MiMoForCausalLM"], "model_type": "qwen2", "hidden_size": 2048,
    "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4,
    "head_dim": 128, "intermediate_size": 5632, "vocab_size": 32000,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "hidden_act": "silu", "tie_word_embeddings": False, "num_nextn_predict_layers": 1,
    "torch_dtype": "bfloat16",
}
"""A ~0.5B-parameter MiMo-shaped model: large enough that the vocabulary projection
(which the MTP loss repeats per depth) is a real part of the step."""


def build(mode: str) -> torch.nn.Module:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    from trainer_client.megatron.model import architecture_spec

    spec = architecture_spec(HF_CONFIG)
    kwargs = spec.config_kwargs(HF_CONFIG)
    if mode == "off":
        kwargs["mtp_num_layers"] = None
    config = TransformerConfig(**kwargs, tensor_model_parallel_size=1)
    layer_spec = get_gpt_layer_local_spec(normalization=config.normalization)
    mtp_spec = (None if mode == "off" else
                get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=False))
    return GPTModel(config=config, transformer_layer_spec=layer_spec, mtp_block_spec=mtp_spec,
                    **spec.model_kwargs(HF_CONFIG)).cuda()


def make_batch(batch: int, seq: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, HF_CONFIG["vocab_size"], (batch, seq), generator=gen)
    labels = torch.roll(input_ids, -1, dims=1)
    loss_mask = torch.ones(batch, seq)
    loss_mask[:, : seq // 4] = 0.0  # a prompt
    loss_mask[:, -1] = 0.0
    causal = torch.ones(seq, seq, dtype=torch.bool).triu(1).view(1, 1, seq, seq)
    data = {"input_ids": input_ids, "position_ids": torch.arange(seq).expand(batch, seq),
            "attention_mask": causal, "labels": labels, "loss_mask": loss_mask}
    return {k: v.cuda() for k, v in data.items()}


def loss_fn(mode: str, model: torch.nn.Module) -> Callable[[dict], torch.Tensor]:
    from trainer_client.megatron.mtp_forward import mtp_forward
    from trainer_client.mtp_loss import (
        MTPLossConfig,
        attach_mtp_loss,
        mtp_depth_losses,
        total_mtp_loss,
    )

    def masked(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return (per_token * mask).sum() / mask.sum()

    if mode in ("off", "megatron"):
        return lambda d: masked(model(**d), d["loss_mask"])
    cfg = MTPLossConfig(num_layers=1, scaling_factor=model.config.mtp_loss_scaling_factor)

    def ours(d: dict) -> torch.Tensor:
        out = mtp_forward(model, **d, detach_trunk=cfg.detach_trunk)
        losses = mtp_depth_losses(out.mtp_hidden, d["labels"], d["loss_mask"],
                                  out.output_weight, None, cfg)
        return masked(attach_mtp_loss(out.main_output, total_mtp_loss(losses)), d["loss_mask"])
    return ours


def time_mode(mode: str, batches: list[dict], warmup: int) -> dict[str, float]:
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    model = build(mode)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-5)
    step_loss = loss_fn(mode, model)
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0, device="cuda"))
    times = []
    for i, data in enumerate(batches):
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = step_loss(data)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
        assert math.isfinite(float(loss.detach())), mode
    peak = torch.cuda.max_memory_allocated() / 2**30
    del model, optimizer
    return {"step_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "peak_gib": peak}


def gpu_table(batch: int, seq: int, steps: int, warmup: int) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    torch.backends.cuda.matmul.allow_tf32 = True
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    batches = [make_batch(batch, seq, seed=i) for i in range(warmup + steps)]
    results = {mode: time_mode(mode, batches, warmup) for mode in ("off", "megatron", "ours")}
    print(f"{torch.cuda.get_device_name()}, fp32 weights (TF32 matmuls), batch {batch} x "
          f"{seq} tokens, {HF_CONFIG['num_hidden_layers']} layers, hidden "
          f"{HF_CONFIG['hidden_size']}, vocab {HF_CONFIG['vocab_size']}, 1 MTP layer; "
          f"median of {steps} steps after {warmup} warm-up")
    print(f"{'mode':<10}{'step s':>10}{'min-max s':>18}{'peak GiB':>10}")
    for mode, r in results.items():
        print(f"{mode:<10}{r['step_s']:>10.4f}{r['min_s']:>9.4f}-{r['max_s']:<8.4f}"
              f"{r['peak_gib']:>10.2f}")
    ratio = results["ours"]["step_s"] / results["megatron"]["step_s"]
    print(f"ours / megatron step time: {ratio:.3f} (target <= 1.05: "
          f"{'met' if ratio <= 1.05 else 'NOT met'}); peak memory ratio "
          f"{results['ours']['peak_gib'] / results['megatron']['peak_gib']:.3f}")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def padding_table(num_samples: int = 20_000, sequences_per_row: int = 8,
                  seed: int = 0) -> None:
    """Log-normal prompt+response lengths (median ~1.2k, long tail), clipped to [32, 16k],
    packed ``sequences_per_row`` to a row in sampling order."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.exp(torch.randn(num_samples, generator=gen) * 0.9 + math.log(1200))
    lengths = [int(min(max(x, 32), 16384)) for x in raw.tolist()]
    print(f"padding overhead (padded tokens / real tokens) of packed rows over {num_samples} "
          f"log-normal lengths (median {int(statistics.median(lengths))}), "
          f"{sequences_per_row} sequences per row:")
    print(f"{'tp':>4}{'cp':>4}{'ours':>12}{'before':>12}{'verl':>12}{'before/ours':>13}"
          f"{'verl/ours':>11}")
    for tp, cp in [(1, 1), (2, 1), (8, 1), (2, 2), (4, 2), (8, 2), (4, 4), (8, 4), (3, 2),
                   (8, 8)]:
        ours, before, verl = (padding_overhead(lengths, tp, cp, rule=rule,
                                               sequences_per_row=sequences_per_row)
                              for rule in ("ours", "lcm_per_sequence", "verl"))
        print(f"{tp:>4}{cp:>4}{ours:>12.5f}{before:>12.5f}{verl:>12.5f}"
              f"{before / ours if ours else float('nan'):>13.2f}"
              f"{verl / ours if ours else float('nan'):>11.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--padding-only", action="store_true")
    args = parser.parse_args()
    padding_table()
    if not args.padding_only:
        gpu_table(args.batch, args.seq, args.steps, args.warmup)


if __name__ == "__main__":
    main()
