"""Tensor parallelism 2 on CPU (gloo, two spawned ranks, megatron-core 0.16).

The checks are in ``tp_checks.py``; ``test_gpu_tp2.py`` runs the same ones on two GPUs.
Float32 parameters: TP 2 and TP 1 then differ only by reduction order.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.spawned import rendezvous_address, run_ranks
from tests.support.tp_checks import check_tp2_matches_tp1, check_train_step_and_push
from tests.unit.trainer_client.test_mtp_forward import tiny_config

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="CPU-only (gloo); with CUDA present megatron builds on the GPU: test_gpu_tp2.py")


def test_tp2_losses_gradients_and_export_match_tp1() -> None:
    addresses = [rendezvous_address(), rendezvous_address()]
    results = run_ranks(check_tp2_matches_tp1, 2, addresses, "cpu", "float32",
                        tiny_config(num_depths=2), timeout_s=300)
    result = results[0]
    assert max(result["loss_rel_errors"]) < 1e-5, result
    assert result["max_grad_rel_error"] < 1e-4, result
    assert result["num_grads_compared"] > 20


def test_tp2_training_step_then_push_delivers_the_export() -> None:
    result = run_ranks(check_train_step_and_push, 2, rendezvous_address(), "cpu", "bfloat16",
                       tiny_config(num_depths=1), 1, timeout_s=300)[0]
    assert result["num_tensors"] > 20 and result["num_bytes"] > 0
