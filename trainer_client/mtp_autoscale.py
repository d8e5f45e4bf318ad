"""The MTP loss's ride on the main loss's backward: megatron-core's ``MTPLossAutoScaler``.

Runs in the trainer process, inside the forward step (:func:`attach_mtp_loss`) and
wherever the trainer sets its loss scale (:func:`set_mtp_loss_backward_scale`). No
communication. A trainer backpropagates one loss, the main one; the MTP loss reaches
the parameters because an identity function on the main output hands it a gradient in
backward. megatron-core's own autoscaler is used when importable, since Megatron's
schedules set its scale every step; without megatron-core an equivalent stands in
(NVIDIA/Megatron-LM ``megatron/core/transformer/multi_token_prediction.py``,
``MTPLossAutoScaler``). The loss itself is :mod:`trainer_client.mtp_loss`'s.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["attach_mtp_loss", "get_mtp_loss_backward_scale", "set_mtp_loss_backward_scale"]


class _MTPLossAutoScaler(torch.autograd.Function):
    """Used only without megatron-core: same contract as its ``MTPLossAutoScaler``.

    Forward returns ``output`` unchanged; backward passes ``output``'s gradient through
    and gives the MTP loss the gradient ``ones * main_loss_backward_scale``, so one
    backward of the main loss also backpropagates the MTP loss.
    """

    main_loss_backward_scale: torch.Tensor = torch.tensor(1.0)

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, mtp_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(mtp_loss)
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (mtp_loss,) = ctx.saved_tensors
        scale = _MTPLossAutoScaler.main_loss_backward_scale
        return grad_output, torch.ones_like(mtp_loss) * scale.to(mtp_loss.device)

    @staticmethod
    def set_loss_scale(scale: torch.Tensor) -> None:
        _MTPLossAutoScaler.main_loss_backward_scale = scale


def _autoscaler() -> Any:
    """megatron-core's ``MTPLossAutoScaler`` when it has the expected API, else ours.

    Megatron's is preferred because its schedules set its scale every step
    (``loss_scale / num_microbatches``, or ``loss_scale`` in per-token mode).
    """
    try:
        from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler
    except ImportError:
        return _MTPLossAutoScaler
    if all(hasattr(MTPLossAutoScaler, name)
           for name in ("apply", "set_loss_scale", "main_loss_backward_scale")):
        return MTPLossAutoScaler
    return _MTPLossAutoScaler


def attach_mtp_loss(main_output: torch.Tensor, total_mtp_loss: torch.Tensor) -> torch.Tensor:
    """Return ``main_output`` unchanged, with ``total_mtp_loss`` riding on its backward.

    When the main loss is backpropagated through the returned tensor, ``total_mtp_loss``
    receives the gradient ``s`` (per element), ``s`` being the autoscaler's
    ``main_loss_backward_scale`` (:func:`get_mtp_loss_backward_scale`): the parameters get
    ``s * d(total_mtp_loss)/d(param)`` on top of the main gradient, whatever the main
    loss's own gradient into ``main_output`` is. Megatron's schedules set ``s`` to match
    the main loss's scale; outside them, set it with :func:`set_mtp_loss_backward_scale`.

    Uses megatron-core's ``MTPLossAutoScaler`` when importable, else an equivalent.
    """
    return _autoscaler().apply(main_output, total_mtp_loss)


def set_mtp_loss_backward_scale(scale: float | torch.Tensor) -> None:
    """Set ``s`` of :func:`attach_mtp_loss` (process-wide, shared with Megatron's schedules)."""
    _autoscaler().set_loss_scale(torch.as_tensor(scale, dtype=torch.float32))


def get_mtp_loss_backward_scale() -> torch.Tensor:
    """The current ``s`` of :func:`attach_mtp_loss`."""
    return _autoscaler().main_loss_backward_scale
