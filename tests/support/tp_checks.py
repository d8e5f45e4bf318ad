"""Tensor parallelism 2 against 1: the checks, device-agnostic, one call per spawned rank.

Each function is the body of one rank of a two-process world: gloo on CPU
(``test_tp2.py``, megatron-core 0.16 with the CPU replacements, every CI run) or NCCL on
two GPUs (``test_gpu_tp2.py``, megatron-core 0.19). Rank 0 returns the figures; every
rank runs every collective.

1. :func:`check_tp2_matches_tp1`: the same weights and batch with TP 1 and TP 2: the main
   loss and each MTP depth's loss agree; the gradients of every parameter from the MTP
   loss alone agree once the TP 2 shards are gathered (compared under checkpoint names,
   so the QKV and fc1 layouts are undone by the converter); the output layer's gradient
   from the MTP loss alone is exactly zero on both vocabulary shards; the TP 2 export is
   bit-identical to the TP 1 export of the same weights.
2. :func:`check_train_step_and_push`: one training step under TP 2 (main + MTP loss,
   Adam), then ``loop.push`` to a :class:`~tests.support.receiver.LocalReceiver`:
   a refused push leaves no rank waiting in an all-gather, and an accepted one delivers
   exactly the exported bytes; export + gather and the push are timed.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from tests.unit.trainer_client.test_mtp_forward import batch, masked_mean


def _device(device_type: str, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def megatron_parallel(device: torch.device, tp_size: int, rank: int, world_size: int,
                      init_method: str) -> Iterator[None]:
    """torch.distributed and megatron's parallel_state for one phase of a check."""
    if device.type == "cpu":
        from trainer_client.megatron.model import init_parallel_cpu

        torch.set_num_threads(1)
        with init_parallel_cpu(tp_size, rank=rank, world_size=world_size,
                               init_method=init_method):
            yield
        return
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world_size,
                            device_id=device)
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size)
        torch.manual_seed(0)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _tp_group() -> Any:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def _losses_and_grads(model: torch.nn.Module, config: dict, data: dict[str, torch.Tensor],
                      tp_group: Any
                      ) -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    """[main loss, depth 1 loss, ...], every parameter's gradient from the MTP loss
    alone, gathered over ``tp_group`` and named as in the checkpoint (float32, CPU), and
    each depth's count of top-1 agreements."""
    import torch.distributed as dist

    from trainer_client.megatron.convert import megatron_to_hf
    from trainer_client.megatron.mtp_forward import mtp_forward
    from trainer_client.mtp_loss import MTPLossConfig, mtp_depth_losses, total_mtp_loss

    cfg = MTPLossConfig(num_layers=int(config["num_nextn_predict_layers"]), scaling_factor=0.3)
    model.zero_grad(set_to_none=True)
    # detach_trunk=False: the MTP loss's gradient then crosses every TP layer of the trunk
    # too, so every parameter's gradient is compared (with the cut, the trunk's are 0).
    out = mtp_forward(model, **data, detach_trunk=False)
    main_loss = masked_mean(out.main_output, data["loss_mask"])
    depths = mtp_depth_losses(out.mtp_hidden, data["labels"], data["loss_mask"],
                              out.output_weight, None, cfg, tp_group=tp_group)
    total_mtp_loss(depths).backward()
    output_grad = model.output_layer.weight.grad
    assert output_grad is None or torch.count_nonzero(output_grad) == 0, \
        "the MTP loss reached the output layer"
    tp_size = dist.get_world_size(tp_group)
    per_rank: list[dict[str, torch.Tensor]] = [{} for _ in range(tp_size)]
    for name, param in model.named_parameters():
        grad = torch.zeros_like(param) if param.grad is None else param.grad.contiguous()
        shards = [torch.empty_like(grad) for _ in range(tp_size)]
        dist.all_gather(shards, grad, group=tp_group)
        for rank, shard in enumerate(shards):
            per_rank[rank][name] = shard
    grads = {name: t.float().cpu() for name, t in megatron_to_hf(per_rank, config)}
    losses = [float(main_loss)] + [float(d.loss_sum / d.num_tokens) for d in depths]
    return losses, grads, [float(d.num_correct) for d in depths]


def check_tp2_matches_tp1(rank: int, addresses: list[str], device_type: str,
                          params_dtype: str, config: dict) -> dict[str, Any]:
    """Check 1 of the module docstring on one rank of two; returns the largest errors."""
    import torch.distributed as dist

    from trainer_client.megatron.convert import export_hf_weights, load_hf_state
    from trainer_client.megatron.model import build_gpt_mtp_model

    device, dtype = _device(device_type, rank), getattr(torch, params_dtype)
    data = batch(config["vocab_size"], device)

    with megatron_parallel(device, 1, rank, 2, addresses[0]):  # TP 1, two DP ranks
        model = build_gpt_mtp_model(config, params_dtype=dtype).to(device)
        weights = {name: t.contiguous().clone()
                   for name, t in export_hf_weights(model, config, dtype=dtype)}
        for tensor in weights.values():  # one set of weights, whatever each rank drew
            dist.broadcast(tensor, src=0)
        load_hf_state(model, weights, config)
        ref_losses, ref_grads, ref_correct = _losses_and_grads(model, config, data,
                                                               _tp_group())
        del model

    with megatron_parallel(device, 2, rank, 2, addresses[1]):
        tp_group = _tp_group()
        model = build_gpt_mtp_model(config, tp_size=2, params_dtype=dtype).to(device)
        load_hf_state(model, weights, config, tp_rank=rank, tp_size=2)
        losses, grads, correct = _losses_and_grads(model, config, data, tp_group)
        exported = list(export_hf_weights(model, config, tp_group, dtype=dtype))

    assert [name for name, _ in exported] == list(weights)
    not_identical = [name for name, t in exported if not torch.equal(t, weights[name])]
    assert not not_identical, f"TP 2 export differs from TP 1's: {not_identical}"
    # The top-1 token from two vocabulary shards (max, then the smallest index holding it)
    # is the full vocabulary's; a logit tie broken by rounding may move one count.
    assert all(abs(a - b) <= 1 for a, b in zip(correct, ref_correct, strict=True)), \
        (correct, ref_correct)
    assert grads.keys() == ref_grads.keys()
    grad_errors = {}
    for name, ref in ref_grads.items():
        if name == "lm_head.weight":
            assert torch.count_nonzero(ref) == torch.count_nonzero(grads[name]) == 0
            continue
        assert torch.count_nonzero(ref) > 0, f"{name}: no gradient from the MTP loss"
        grad_errors[name] = float((grads[name] - ref).norm() / ref.norm())
    loss_errors = [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)]
    worst_grad = max(grad_errors, key=grad_errors.__getitem__)
    mtp_grads = {n: e for n, e in grad_errors.items() if n.startswith("model.mtp_layers.")}
    return {"losses_tp1": ref_losses, "losses_tp2": losses, "loss_rel_errors": loss_errors,
            "max_grad_rel_error": grad_errors[worst_grad], "worst_grad": worst_grad,
            "max_mtp_grad_rel_error": max(mtp_grads.values()),
            "num_grads_compared": len(grad_errors), "num_exported": len(exported)}


def check_train_step_and_push(rank: int, address: str, device_type: str, params_dtype: str,
                              config: dict, num_pushes: int) -> dict[str, Any] | None:
    """Check 2 of the module docstring on one rank of two; rank 0 returns the timings."""
    import torch.distributed as dist

    from rollout_service.client import ServiceError
    from tests.support.receiver import LocalReceiver, tensor_digest
    from trainer_client.loop import push
    from trainer_client.megatron.convert import export_hf_weights
    from trainer_client.megatron.model import build_gpt_mtp_model
    from trainer_client.megatron.mtp_forward import mtp_forward
    from trainer_client.mtp_loss import (
        MTPLossConfig,
        attach_mtp_loss,
        mtp_depth_losses,
        set_mtp_loss_backward_scale,
        total_mtp_loss,
    )
    from trainer_client.push import WeightPusher

    device, dtype = _device(device_type, rank), getattr(torch, params_dtype)
    with megatron_parallel(device, 2, rank, 2, address):
        tp_group = _tp_group()
        model = build_gpt_mtp_model(config, tp_size=2, params_dtype=dtype).to(device)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        cfg = MTPLossConfig(num_layers=int(config["num_nextn_predict_layers"]))
        set_mtp_loss_backward_scale(1.0)
        data = batch(config["vocab_size"], device)
        _sync(device)
        start = time.perf_counter()
        out = mtp_forward(model, **data, detach_trunk=cfg.detach_trunk)
        depths = mtp_depth_losses(out.mtp_hidden, data["labels"], data["loss_mask"],
                                  out.output_weight, None, cfg, tp_group=tp_group)
        loss = masked_mean(attach_mtp_loss(out.main_output, total_mtp_loss(depths)),
                           data["loss_mask"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        step_s = time.perf_counter() - start

        # A refused push: rank 0 raises, and no rank is left in an all-gather.
        refused = None
        with LocalReceiver(reject_begin_with=409) as receiver, \
                WeightPusher(receiver.url, "t") if rank == 0 else _none() as pusher:
            try:
                push(pusher, model, config, version=1, target="both", tp_group=tp_group)
            except ServiceError as exc:
                refused = exc.status
        assert (refused == 409) if rank == 0 else refused is None
        dist.barrier()

        export_s, reports = [], []
        with LocalReceiver() as receiver, \
                WeightPusher(receiver.url, "t") if rank == 0 else _none() as pusher:
            for version in range(1, num_pushes + 2):  # the first one warms the segment up
                _sync(device)
                start = time.perf_counter()
                for _ in export_hf_weights(model, config, tp_group):
                    pass
                _sync(device)
                export_s.append(time.perf_counter() - start)
                reports.append(push(pusher, model, config, version=version, target="both",
                                    tp_group=tp_group))
            digests = {name: tensor_digest(t)
                       for name, t in export_hf_weights(model, config, tp_group)}
            received = receiver.digests() if rank == 0 else {}
    if rank != 0:
        return None
    assert received == digests, "the receiver got other bytes than the export"
    timed = reports[1:]
    num_bytes = timed[0].num_bytes
    median = {key: statistics.median(getattr(r, key) for r in timed)
              for key in ("fill_s", "control_s", "total_s")}
    export_median = statistics.median(export_s[1:])
    return {"train_step_s": step_s, "num_bytes": num_bytes, "num_tensors": timed[0].num_tensors,
            "export_gather_s": export_median, "export_gather_gb_s": num_bytes / export_median / 1e9,
            **median, "push_gb_s": num_bytes / median["total_s"] / 1e9,
            "num_pushes": len(timed)}


@contextmanager
def _none() -> Iterator[None]:
    yield None
