"""Packed (THD) batches through the real ``GPTModel`` + MTP, against the same sequences padded.

``pack_thd`` -> ``megatron.packed.packed_seq_params`` -> ``mtp_forward`` -> our MTP loss,
per sequence, against ``pack_padded`` (BSHD) -> ``mtp_forward`` -> our MTP loss: the main
loss, each depth's MTP loss and token count, the MTP hidden states wherever their input
is a real token, and the gradient of every parameter from each sequence's loss.

What runs where. megatron-core's local spec cannot run THD at all: its
``DotProductAttention.forward`` asserts ``packed_seq_params is None`` ("Packed sequence is
not supported by DotProductAttention. Please use TEDotProductAttention instead"; 0.16
and 0.19 alike), and Transformer Engine (the only THD attention Megatron has) needs CUDA.
So on CPU the attention kernel, and only it, is :class:`FakeThdCoreAttention`: Megatron's
own local attention run on each sequence of the row in turn. Everything else is the
real model: THD embedding and RoPE (restarting at each boundary), the decoder, the MTP
block with its packed ``roll_tensor`` (which reads ``cu_seqlens_q``), our loss. A
negative control passes the *real* boundaries as ``cu_seqlens_q`` (what the name
suggests) and shows the MTP losses moving while the main loss does not. ``test_gpu.py``
runs the same check on CUDA (megatron-core 0.19) and the full comparison with
Transformer Engine's attention where it is installed.

MTP recompute with THD: refused by ``mtp_forward`` with a ValueError naming the
TransformerConfig options on megatron-core < 0.18 (this CPU run, 0.16), else run and
compared with the run without recompute.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.support.spawned import rendezvous_address, run_spawned
from tests.unit.trainer_client.test_mtp_forward import (
    NUM_DEPTHS,
    RECOMPUTE,
    losses_and_grads,
    tiny_config,
)
from trainer_client.batch import Rollout, pack_padded, pack_thd

PAD_ID = 0
PACK_CP = 2
"""The rows are padded as for CP 2 (each sequence to a multiple of 4), so the sequences
have padding between them, and run on one rank."""


def rollouts(vocab: int, seed: int = 3) -> list[Rollout]:
    """Three sequences of 9, 14 and 6 tokens: padded to 12, 16 and 8 in the packed row."""
    gen = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(1, vocab, (n,), generator=gen).tolist()
    return [Rollout(prompt_ids=ids(3), response_ids=ids(6)),
            Rollout(prompt_ids=ids(5), response_ids=ids(9), response_mask=[1] * 7 + [0, 1]),
            Rollout(prompt_ids=ids(2), response_ids=ids(4))]


class FakeThdCoreAttention(torch.nn.Module):
    """FAKE THD attention for the local spec: megatron-core's own ``DotProductAttention``
    applied to each sequence of the packed row, causal within it.

    Stands in for Transformer Engine's THD kernels (CUDA only) with their meaning of the
    boundaries: sequence ``i`` starts at ``cu_seqlens_q_padded[i]`` (``cu_seqlens_q[i]``
    without it) and has ``cu_seqlens_q[i + 1] - cu_seqlens_q[i]`` tokens attended; the rest
    of its span gets zeros. Without ``packed_seq_params`` it is the wrapped module.
    """

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: object = None,
                attention_bias: object = None, packed_seq_params: object = None,
                **kwargs: object) -> torch.Tensor:
        if packed_seq_params is None:
            return self.inner(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                              attention_bias=attention_bias, **kwargs)
        # THD: query [t, heads, d], key/value [t, groups, d] -> [t, 1, heads * d].
        lengths = packed_seq_params.cu_seqlens_q.diff().tolist()
        bounds = packed_seq_params.cu_seqlens_q_padded
        bounds = (packed_seq_params.cu_seqlens_q if bounds is None else bounds).tolist()
        pieces = []
        for start, end, length in zip(bounds[:-1], bounds[1:], lengths, strict=True):
            span = slice(start, start + length)
            causal = torch.ones(length, length, dtype=torch.bool,
                                device=query.device).triu(1).view(1, 1, length, length)
            pieces.append(self.inner(query[span].unsqueeze(1), key[span].unsqueeze(1),
                                     value[span].unsqueeze(1), causal,
                                     attn_mask_type=attn_mask_type))
            pieces.append(query.new_zeros(end - start - length, 1, pieces[-1].size(-1)))
        return torch.cat(pieces, dim=0)


def install_fake_thd_attention(model: torch.nn.Module) -> int:
    """Wraps every local ``core_attention`` (decoder and MTP layers); returns how many."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    attentions = [m for m in model.modules()
                  if isinstance(getattr(m, "core_attention", None), DotProductAttention)]
    for module in attentions:
        module.core_attention = FakeThdCoreAttention(module.core_attention)
    return len(attentions)


# --------------------------------------------------------------------------- the check

def _forward(model: torch.nn.Module, rs: list[Rollout], layout: str, device: torch.device,
             real_cu_seqlens_q: bool) -> tuple[object, object, list[tuple[int, slice]]]:
    """``mtp_forward`` of the whole batch in one layout: output, batch, and where each
    sequence lies (row, positions)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from trainer_client.megatron.mtp_forward import mtp_forward
    from trainer_client.megatron.packed import packed_seq_params

    if layout == "bshd":
        batch = pack_padded(rs, tp=1, cp=1, pad_id=PAD_ID)
        seq = batch.input_ids.size(1)
        # The local attention builds its default causal mask on "cuda": give it one.
        # Transformer Engine's causal kernels take none.
        is_local = any(isinstance(m, DotProductAttention) for m in model.modules())
        causal = (torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)
                  .view(1, 1, seq, seq) if is_local else None)
        out = mtp_forward(model, batch.input_ids.to(device), batch.position_ids.to(device),
                          causal, batch.labels.to(device), batch.loss_mask.to(device),
                          detach_trunk=False)
        return out, batch, [(i, slice(0, seq)) for i in range(len(rs))]
    batch = pack_thd(rs, tp=1, cp=PACK_CP, pad_id=PAD_ID)
    assert not torch.equal(batch.cu_seqlens, batch.cu_seqlens_padded)  # padding between
    params = packed_seq_params(batch, device=device)
    if real_cu_seqlens_q:  # the negative control: the real boundaries where Megatron rolls
        params.cu_seqlens_q = params.cu_seqlens_kv = batch.cu_seqlens.to(device)
    out = mtp_forward(model, batch.input_ids.to(device), batch.position_ids.to(device), None,
                      batch.labels.to(device), batch.loss_mask.to(device), params,
                      detach_trunk=False)
    bounds = batch.cu_seqlens_padded.tolist()
    return out, batch, [(0, slice(a, b)) for a, b in zip(bounds, bounds[1:])]


def _per_sequence(model: torch.nn.Module, rs: list[Rollout], layout: str, device: torch.device,
                  cfg: object, *, real_cu_seqlens_q: bool = False) -> list[dict]:
    """Per sequence: main loss sum, per-depth (L_k, N_k), MTP hidden states over the
    positions whose MTP input is a real token, and the gradient of main + MTP loss (one
    forward per sequence: Megatron's cross-entropy backward reuses its saved softmax in
    place, so one graph takes one backward)."""
    from trainer_client.mtp_loss import mtp_depth_losses, total_mtp_loss

    names = [name for name, _ in model.named_parameters()]
    results = []
    for i, rollout in enumerate(rs):
        out, batch, spans = _forward(model, rs, layout, device, real_cu_seqlens_q)
        row, span = spans[i]
        labels = batch.labels.to(device)[row:row + 1, span]
        loss_mask = batch.loss_mask.to(device)[row:row + 1, span]
        main = (out.main_output[row:row + 1, span] * loss_mask).sum()
        hidden = [h[span, row:row + 1] for h in out.mtp_hidden]
        depths = mtp_depth_losses(hidden, labels, loss_mask, out.output_weight, None, cfg)
        grads = torch.autograd.grad(main + total_mtp_loss(depths),
                                    [p for _, p in model.named_parameters()], allow_unused=True)
        length = rollout.num_tokens
        results.append({
            "main": main.detach(),
            "mtp": [(d.loss_sum.detach(), d.num_tokens) for d in depths],
            # Depth k at position t embeds token t + k: real for t < length - k.
            "hidden": [h[:length - k].detach() for k, h in enumerate(hidden, start=1)],
            "grads": {name: (torch.zeros_like(p) if g is None else g)
                      for name, p, g in zip(names, model.parameters(), grads, strict=True)},
        })
    return results


FLOAT32_TOLERANCES = {"loss": 1e-5, "hidden": 1e-4, "grad": 1e-4}
"""Relative: per-sequence loss sums, the largest hidden-state difference over the largest
value, gradient L2 error. float32 on one rank: only summation order differs."""


def _relative(got: torch.Tensor, want: torch.Tensor, *, norm: str = "l2") -> float:
    diff, ref = (got - want).float(), want.float()
    if norm == "max":
        return float(diff.abs().max() / ref.abs().max().clamp(min=1e-30))
    return float(diff.norm() / ref.norm().clamp(min=1e-30))


def check_thd_matches_bshd(device: torch.device, *, use_transformer_engine: bool = False,
                           params_dtype: torch.dtype = torch.float32,
                           tolerances: dict[str, float] = FLOAT32_TOLERANCES
                           ) -> dict[str, float]:
    """The module docstring's comparison; parallel_state must be up (TP 1). Returns the
    largest relative differences seen and the negative control's."""
    from trainer_client.megatron.model import build_gpt_mtp_model
    from trainer_client.mtp_loss import MTPLossConfig, set_mtp_loss_backward_scale

    config = tiny_config()
    torch.manual_seed(0)
    model = build_gpt_mtp_model(config, params_dtype=params_dtype,
                                use_transformer_engine=use_transformer_engine).to(device)
    if not use_transformer_engine:
        assert install_fake_thd_attention(model) == config["num_hidden_layers"] + NUM_DEPTHS
    cfg = MTPLossConfig(num_layers=NUM_DEPTHS)
    set_mtp_loss_backward_scale(1.0)
    rs = rollouts(config["vocab_size"])
    padded = _per_sequence(model, rs, "bshd", device, cfg)
    packed = _per_sequence(model, rs, "thd", device, cfg)
    worst = {"loss": 0.0, "hidden": 0.0, "grad": 0.0}

    def record(kind: str, error: float, what: str) -> None:
        worst[kind] = max(worst[kind], error)
        assert error <= tolerances[kind], f"{what}: relative difference {error:.2e}"

    for i, (want, got) in enumerate(zip(padded, packed, strict=True)):
        record("loss", _relative(got["main"], want["main"]), f"sequence {i}: main loss")
        for k, ((got_sum, got_n), (want_sum, want_n)) in enumerate(
                zip(got["mtp"], want["mtp"], strict=True), start=1):
            assert got_n == want_n, (i, k)
            record("loss", _relative(got_sum, want_sum), f"sequence {i}: MTP depth {k} loss")
        for k, (got_h, want_h) in enumerate(zip(got["hidden"], want["hidden"], strict=True),
                                            start=1):
            record("hidden", _relative(got_h, want_h, norm="max"),
                   f"sequence {i}: MTP depth {k} hidden states")
        for name, want_grad in want["grads"].items():
            assert want_grad.any(), f"sequence {i}: no gradient for {name}"
            record("grad", _relative(got["grads"][name], want_grad),
                   f"sequence {i}: gradient of {name}")

    # Negative control: the real boundaries as cu_seqlens_q roll the MTP inputs over the
    # wrong tokens from the first padded sequence on; the main model does not use them.
    wrong = _per_sequence(model, rs, "thd", device, cfg, real_cu_seqlens_q=True)
    moved = []
    for i, (w, p) in enumerate(zip(wrong, padded, strict=True)):
        assert _relative(w["main"], p["main"]) <= tolerances["loss"], i
        change = max(_relative(got, want, norm="max")
                     for got, want in zip(w["hidden"], p["hidden"], strict=True))
        if i == 0:  # it starts at 0 either way, and its own padding comes after it
            assert change <= tolerances["hidden"], change
        else:
            assert change > 0.1, f"sequence {i}: real cu_seqlens_q moved its MTP hidden " \
                                 f"states by only {change:.2e}"
            moved.append(change)
    return {**worst, "negative_control_hidden_change": min(moved)}


def check_thd_recompute(device: torch.device) -> str:
    """MTP recompute with a packed batch: refused (< 0.18) or equal to no recompute."""
    from trainer_client.megatron.model import build_gpt_mtp_model
    from trainer_client.megatron.mtp_forward import mtp_forward, mtp_recompute_breaks_thd
    from trainer_client.megatron.packed import packed_seq_params
    from trainer_client.mtp_loss import MTPLossConfig, set_mtp_loss_backward_scale

    config = tiny_config()
    torch.manual_seed(0)
    plain = build_gpt_mtp_model(config).to(device)
    recomputed = build_gpt_mtp_model(config, transformer_config=RECOMPUTE).to(device)
    recomputed.load_state_dict(plain.state_dict())
    for model in (plain, recomputed):
        install_fake_thd_attention(model)
    batch = pack_thd(rollouts(config["vocab_size"]), tp=1, cp=PACK_CP, pad_id=PAD_ID)
    params = packed_seq_params(batch, device=device)
    args = (batch.input_ids.to(device), batch.position_ids.to(device), None,
            batch.labels.to(device), batch.loss_mask.to(device), params)
    if mtp_recompute_breaks_thd():
        with pytest.raises(ValueError, match="recompute_granularity='full'.*THD"):
            mtp_forward(recomputed, *args, detach_trunk=True)
        return "refused"
    cfg = MTPLossConfig(num_layers=NUM_DEPTHS)
    set_mtp_loss_backward_scale(1.0)
    cu_seqlens = batch.cu_seqlens_padded.to(device)
    for detach_trunk in (True, False):
        want = losses_and_grads(plain, args, cfg, detach_trunk=detach_trunk,
                                cu_seqlens=cu_seqlens)
        got = losses_and_grads(recomputed, args, cfg, detach_trunk=detach_trunk,
                               cu_seqlens=cu_seqlens)
        assert got.pop("recomputed") and not want.pop("recomputed"), "MTP layer not recomputed"
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    return "matches"


# --------------------------------------------------------------------------- CPU process

def _worker(checks: list, address: str, errors: object) -> None:
    try:
        warnings.filterwarnings("ignore")
        torch.set_num_threads(2)
        from trainer_client.megatron.model import init_parallel_cpu

        with init_parallel_cpu(init_method=address):
            for check in checks:
                check(torch.device("cpu"))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent with its traceback
        import traceback
        errors.put(f"{exc!r}\n{traceback.format_exc()}")
        return
    errors.put(None)


def test_packed_batch_through_gpt_model_matches_padded_per_sequence() -> None:
    pytest.importorskip("megatron.core")
    run_spawned(_worker, [check_thd_matches_bshd], rendezvous_address(), timeout_s=300)


def _expect_refused(device: torch.device) -> None:
    assert check_thd_recompute(device) == "refused"  # megatron-core 0.16: the CPU build


def test_mtp_recompute_with_a_packed_batch_is_refused_on_megatron_core_0_16() -> None:
    pytest.importorskip("megatron.core")
    run_spawned(_worker, [_expect_refused], rendezvous_address(), timeout_s=300)
