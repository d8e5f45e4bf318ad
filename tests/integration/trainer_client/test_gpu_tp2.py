"""Tensor parallelism 2 on two CUDA GPUs (NCCL, megatron-core 0.19, local spec).

The same checks as ``test_tp2.py`` (``tp_checks.py``), on ``cuda:0`` and ``cuda:1``, in
bfloat16 (what a trainer runs) and float32 (to separate the TP arithmetic from bf16
rounding), plus the timed training step and push on the ``small`` model (105.7M
parameters, 211 MB of bf16 weights). Skipped without two GPUs. Run alone with::

    pytest -m gpu tests/integration/trainer_client/test_gpu_tp2.py -rA -s

The figures are printed.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.spawned import rendezvous_address, run_ranks
from tests.support.tp_checks import check_tp2_matches_tp1, check_train_step_and_push
from tests.unit.trainer_client.test_mtp_forward import tiny_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

# bf16 has 8 mantissa bits (relative step 2**-8 = 0.0039): TP 2's split matmuls and
# all-reduces round at other places than TP 1's.
TOLERANCES = {"bfloat16": {"loss": 1e-2, "grad": 5e-2}, "float32": {"loss": 1e-5, "grad": 1e-4}}


@pytest.mark.parametrize("params_dtype", ["bfloat16", "float32"])
def test_tp2_matches_tp1_on_two_gpus(params_dtype: str) -> None:
    addresses = [rendezvous_address(), rendezvous_address()]
    result = run_ranks(check_tp2_matches_tp1, 2, addresses, "cuda", params_dtype,
                       tiny_config(num_depths=2), timeout_s=300)[0]
    print(f"\n{params_dtype}: losses TP1 {[round(x, 5) for x in result['losses_tp1']]} "
          f"TP2 {[round(x, 5) for x in result['losses_tp2']]}; relative errors "
          f"{[f'{e:.1e}' for e in result['loss_rel_errors']]}; gradients from the MTP loss: "
          f"{result['num_grads_compared']} tensors, max relative error "
          f"{result['max_grad_rel_error']:.1e} ({result['worst_grad']}), MTP layers "
          f"{result['max_mtp_grad_rel_error']:.1e}; lm_head gradient 0 on both shards; "
          f"{result['num_exported']} exported tensors bit-identical to TP 1")
    tolerance = TOLERANCES[params_dtype]
    assert max(result["loss_rel_errors"]) < tolerance["loss"], result
    assert result["max_grad_rel_error"] < tolerance["grad"], result


def test_tp2_training_step_and_push_timed_on_two_gpus() -> None:
    from rollout_service.embedded.tiny_mimo import hf_config, model_size

    result = run_ranks(check_train_step_and_push, 2, rendezvous_address(), "cuda", "bfloat16",
                       hf_config(model_size("small")), 3, timeout_s=400)[0]
    mb = result["num_bytes"] / 1e6
    print(f"\nsmall model, TP 2, bf16: first training step (with CUDA warm-up) "
          f"{result['train_step_s'] * 1e3:.0f} ms; "
          f"{result['num_tensors']} tensors, {mb:.1f} MB; median of {result['num_pushes']}: "
          f"export + gather {result['export_gather_s'] * 1e3:.1f} ms "
          f"({result['export_gather_gb_s']:.2f} GB/s); push end to end (export + gather + "
          f"device-to-host fill + control) {result['total_s'] * 1e3:.1f} ms "
          f"({result['push_gb_s']:.2f} GB/s), of which fill {result['fill_s'] * 1e3:.1f} ms, "
          f"gather + begin/update calls {result['control_s'] * 1e3:.1f} ms")
    assert result["num_bytes"] > 200e6
