"""The trainer side on one CUDA GPU: MTP loss, checkpoint conversion, one training step.

Runs in the pytest process with torch.distributed (NCCL, world size 1) and megatron's
parallel_state at TP 1, on whatever megatron-core is installed (0.19 on the project's GPU
machine; the CPU tests cover 0.16). Skipped without CUDA. Run alone with
``pytest -m gpu tests/integration/trainer_client/test_gpu.py -rA``; the timings are printed.

1. ``mtp_forward`` + our MTP loss against Megatron's own forward and MTP loss
   (``test_mtp_forward.check_mtp_forward_against_gpt_model`` on CUDA): output-layer
   gradient from the MTP loss exactly zero, MTP-layer gradients non-zero.
2. The tiny checkpoint loaded with ``convert.load_hf_state`` and exported with
   ``export_hf_weights``: bit-identical to the checkpoint.
3. Training steps with the main loss plus our MTP loss (fp32, Adam), then the export:
   bf16 tensors under the checkpoint's names and shapes.
4. ``detach_trunk`` (``test_mtp_forward.check_mtp_only_grad``): a backward of the MTP
   loss alone leaves every non-MTP parameter's gradient exactly zero; without it the
   trunk's is not zero.
5. Activation recompute of the decoder and MTP layers matches no recompute, padded
   (``check_bshd_recompute``) and packed (``test_thd_forward.check_thd_recompute``: run
   and compared on megatron-core >= 0.18, refused with a ValueError before).
6. Packed (THD) against padded (BSHD) per sequence (``check_thd_matches_bshd``): with the
   CPU test's FAKE per-sequence attention (everything but the attention kernel is
   Megatron's, 0.19 here), and with Transformer Engine's THD attention where TE is
   installed (bf16; skipped without TE; its tolerances are estimates until it has run).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.support.spawned import rendezvous_address
from tests.unit.trainer_client.test_mtp_forward import (
    BATCH,
    SEQ,
    batch,
    check_bshd_recompute,
    check_mtp_forward_against_gpt_model,
    check_mtp_only_grad,
    masked_mean,
)
from tests.unit.trainer_client.test_thd_forward import check_thd_matches_bshd, check_thd_recompute

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

Checkpoint = tuple[dict[str, torch.Tensor], dict]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@pytest.fixture(scope="module")
def megatron_cuda() -> Iterator[torch.device]:
    """NCCL world of one, parallel_state at TP 1, megatron's CUDA RNG tracker seeded."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=rendezvous_address(), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        yield device
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    from safetensors.torch import load_file

    from rollout_service.embedded import ensure_model

    path = Path(ensure_model("tiny", cache_dir=tmp_path_factory.mktemp("cache")))
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    return load_file(str(path / "model.safetensors")), config


# --------------------------------------------------------------------------- checks
# Plain functions of a device, so they also run on CPU where megatron-core allows it.

def check_mtp_loss(device: torch.device) -> float:
    """Check 1; returns its wall time in seconds."""
    start = time.perf_counter()
    check_mtp_forward_against_gpt_model(device)
    _sync(device)
    return time.perf_counter() - start


def _megatron_names_match(model: torch.nn.Module, config: dict) -> None:
    """The converter's Megatron names are the model's parameters, or a readable failure."""
    from trainer_client.megatron.model import architecture_spec

    mapped = {tmap.megatron for tmap in architecture_spec(config).tensor_maps(config)}
    actual = {name for name, _ in model.named_parameters()}
    assert mapped == actual, (
        f"model.py's tensor maps do not name this megatron-core's parameters: "
        f"{len(mapped - actual)} mapped names are not parameters, e.g. "
        f"{sorted(mapped - actual)[:3]}; {len(actual - mapped)} parameters are not mapped, "
        f"e.g. {sorted(actual - mapped)[:3]}")


def check_conversion(device: torch.device, checkpoint: Checkpoint,
                     params_dtype: torch.dtype) -> dict[str, float]:
    """Check 2: HF -> model on ``device`` -> HF is bit-identical. Returns timings (s)."""
    from rollout_service.embedded.tiny_mimo import TINY, checkpoint_shapes
    from trainer_client.megatron.convert import export_hf_weights, hf_tensor_shapes, load_hf_state
    from trainer_client.megatron.model import build_gpt_mtp_model

    hf_state, config = checkpoint
    model = build_gpt_mtp_model(config, params_dtype=params_dtype).to(device)
    _megatron_names_match(model, config)
    _sync(device)
    start = time.perf_counter()
    load_hf_state(model, hf_state, config)
    _sync(device)
    load_s = time.perf_counter() - start
    # Linear weights take params_dtype; the local spec's norms stay float32.
    assert all(p.device == device for p in model.parameters())
    assert model.output_layer.weight.dtype == params_dtype

    start = time.perf_counter()
    exported = list(export_hf_weights(model, config))
    _sync(device)
    export_s = time.perf_counter() - start
    names = [name for name, _ in exported]
    assert names == list(hf_tensor_shapes(model, config))
    assert dict(hf_tensor_shapes(model, config)) == checkpoint_shapes(TINY)
    assert set(names) == set(hf_state)
    for name, tensor in exported:
        assert tensor.device == device, name
        assert tensor.dtype == hf_state[name].dtype == torch.bfloat16, name
        assert torch.equal(tensor.cpu(), hf_state[name]), name
    return {"load_s": load_s, "export_s": export_s}


def train_and_export(device: torch.device, config: dict, *, num_steps: int = 3,
                     lr: float = 1e-3) -> list[dict[str, float]]:
    """Check 3: ``num_steps`` Adam steps on main + MTP loss (fp32), then the export.

    Prints the losses and timings; returns the logged losses per step."""
    from rollout_service.embedded.tiny_mimo import TINY, checkpoint_shapes
    from trainer_client.megatron.convert import (
        export_hf_weights,
        hf_tensor_shapes,
        hf_to_megatron,
    )
    from trainer_client.megatron.model import build_gpt_mtp_model
    from trainer_client.megatron.mtp_forward import mtp_forward
    from trainer_client.mtp_loss import (
        MTPLossConfig,
        attach_mtp_loss,
        mtp_depth_losses,
        reduce_for_logging,
        set_mtp_loss_backward_scale,
        total_mtp_loss,
    )

    torch.manual_seed(0)
    model = build_gpt_mtp_model(config).to(device)
    cfg = MTPLossConfig(num_layers=int(config["num_nextn_predict_layers"]), scaling_factor=0.3)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    set_mtp_loss_backward_scale(1.0)
    timings: dict[str, list[float]] = {"forward_s": [], "backward_s": [], "step_s": []}
    history = []
    for step in range(num_steps):
        data = batch(config["vocab_size"], device, seed=10 + step)
        _sync(device)
        start = time.perf_counter()
        out = mtp_forward(model, **data, detach_trunk=cfg.detach_trunk)
        losses = mtp_depth_losses(out.mtp_hidden, data["labels"], data["loss_mask"],
                                  out.output_weight, None, cfg)
        main_loss = masked_mean(attach_mtp_loss(out.main_output, total_mtp_loss(losses)),
                                data["loss_mask"])
        _sync(device)
        timings["forward_s"].append(time.perf_counter() - start)
        start = time.perf_counter()
        main_loss.backward()
        _sync(device)
        timings["backward_s"].append(time.perf_counter() - start)
        assert torch.isfinite(main_loss), step
        for name, p in model.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
            if name.startswith("mtp.") and name.endswith(".weight"):
                assert torch.count_nonzero(p.grad) > 0, name
        start = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        timings["step_s"].append(time.perf_counter() - start)
        logged = reduce_for_logging(losses, groups=[], is_source_rank=True)
        history.append({"main_loss": float(main_loss.detach()), **logged})

    unchanged = [name for name, p in model.named_parameters() if torch.equal(p, before[name])]
    assert not unchanged, f"not updated by the optimizer: {unchanged}"
    for step, entry in enumerate(history):
        print(f"step {step}: " + ", ".join(f"{k}={v:.4f}" for k, v in entry.items()))
    fastest = {key: min(values) * 1e3 for key, values in timings.items()}
    print(f"forward+loss {fastest['forward_s']:.1f} ms (first {timings['forward_s'][0] * 1e3:.1f}"
          f" ms), backward {fastest['backward_s']:.1f} ms, Adam step {fastest['step_s']:.1f} ms")

    _megatron_names_match(model, config)
    start = time.perf_counter()
    exported = list(export_hf_weights(model, config))
    _sync(device)
    export_s = time.perf_counter() - start
    shapes = {name: tuple(t.shape) for name, t in exported}
    assert list(shapes) == list(hf_tensor_shapes(model, config))  # the announced order
    assert shapes == checkpoint_shapes(TINY)
    assert all(t.dtype == torch.bfloat16 and t.device == device for _, t in exported)
    # The exported tensors are the trained weights, rounded to bf16.
    back = hf_to_megatron({name: t.cpu() for name, t in exported}, config)
    for name, p in model.named_parameters():
        assert torch.equal(back[name], p.detach().to(torch.bfloat16).cpu()), name
    print(f"export_hf_weights after training: {export_s * 1e3:.1f} ms")
    return history


# --------------------------------------------------------------------------- tests

def test_mtp_loss_on_cuda_matches_megatron_and_spares_the_output_layer(
        megatron_cuda: torch.device) -> None:
    from importlib.metadata import version

    elapsed = check_mtp_loss(megatron_cuda)
    print(f"megatron-core {version('megatron-core')} on {torch.cuda.get_device_name()}: "
          f"MTP loss check ({BATCH}x{SEQ} tokens, 2 MTP depths) in {elapsed:.2f} s")


@pytest.mark.parametrize("params_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_checkpoint_round_trip_on_cuda_is_bit_identical(
        megatron_cuda: torch.device, tiny: Checkpoint, params_dtype: torch.dtype) -> None:
    timings = check_conversion(megatron_cuda, tiny, params_dtype)
    print(f"{params_dtype}: load_hf_state {timings['load_s'] * 1e3:.1f} ms, "
          f"export_hf_weights {timings['export_s'] * 1e3:.1f} ms")


def test_training_steps_with_mtp_loss_then_export(megatron_cuda: torch.device,
                                                  tiny: Checkpoint) -> None:
    torch.cuda.reset_peak_memory_stats()
    train_and_export(megatron_cuda, tiny[1])
    print(f"peak CUDA memory {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")


def test_detach_trunk_on_cuda_leaves_every_non_mtp_gradient_exactly_zero(
        megatron_cuda: torch.device) -> None:
    from importlib.metadata import version

    norms = check_mtp_only_grad(megatron_cuda)
    print(f"megatron-core {version('megatron-core')}: with detach_trunk every non-MTP "
          f"gradient from the MTP loss is 0; without it the embedding's norm is "
          f"{norms['embedding']:.3f}, the decoder layers' summed norms "
          f"{norms['decoder_layers']:.3f}")


def test_recompute_on_cuda_matches_no_recompute_padded_and_packed(
        megatron_cuda: torch.device) -> None:
    check_bshd_recompute(megatron_cuda)
    print(f"MTP recompute with a packed batch: {check_thd_recompute(megatron_cuda)}")


def test_packed_batch_on_cuda_matches_padded_with_the_fake_attention(
        megatron_cuda: torch.device) -> None:
    result = check_thd_matches_bshd(megatron_cuda)
    print("THD vs BSHD (FAKE per-sequence attention, fp32), largest relative differences: "
          + ", ".join(f"{k} {v:.1e}" for k, v in result.items()))


BF16_TOLERANCES = {"loss": 2e-2, "hidden": 5e-2, "grad": 5e-2}
"""THD and BSHD run different attention kernels in bf16 (8 mantissa bits)."""


def test_packed_batch_matches_padded_with_transformer_engine(
        megatron_cuda: torch.device) -> None:
    pytest.importorskip("transformer_engine", reason="THD attention needs Transformer Engine")
    result = check_thd_matches_bshd(megatron_cuda, use_transformer_engine=True,
                                    params_dtype=torch.bfloat16, tolerances=BF16_TOLERANCES)
    print("THD vs BSHD (Transformer Engine, bf16), largest relative differences: "
          + ", ".join(f"{k} {v:.1e}" for k, v in result.items()))
