"""One ``GPTModel`` forward that returns the main output and the MTP hidden states per depth.

Runs in each trainer rank, inside the forward step, on the pipeline stage that holds the
MTP block and the output layer. No communication of its own beyond what the model's
layers do (TP all-reduces, CP exchanges).

Why not ``model(..., labels=...)``: ``GPTModel`` then computes its own MTP loss through the
shared output layer, with the layer's parameters live (they receive MTP gradient), and
the way it does so drifted across megatron-core versions (NVIDIA/Megatron-LM,
``megatron/core/models/gpt/gpt_model.py``): inline in
``GPTModel._postprocess`` on 0.16, through ``process_mtp_loss`` from 0.17 on (0.19 adds
``mtp_detach_heads`` and derives labels from ``input_ids`` when ``labels`` is None, which
crashes on 0.16 and skips the loss on 0.17/0.18). :func:`mtp_forward` never enters either
path. Both versions' ``_postprocess`` run the MTP block and then, on a stage without the
output layer, return the block's output before any MTP loss::

    hidden_states = self.mtp(...)          # [main; depth 1; ...; depth D] on dim 0
    if not self.post_process:
        return hidden_states
    ...MTP loss (inline or process_mtp_loss), output layer, main loss...

So the forward runs with ``post_process`` switched off for the call, a forward hook on
``model.mtp`` checks that what comes back *is* the MTP block's output in that stacked
layout (the one feature this relies on, checked on every call rather than by version),
and the main output is completed here as ``_postprocess`` completes it: output layer,
0.19's MuP logit scaling where the model has it, ``compute_language_model_loss``. No
full-vocabulary logits are computed for the MTP depths and no Megatron MTP loss graph is
kept alive; Megatron's ``MTPLossLoggingHelper`` records nothing (log with
``mtp_loss.reduce_for_logging`` instead). Megatron's ``mtp_loss_scaling_factor`` plays no
part: scale with ``MTPLossConfig.scaling_factor``.

Typical use in a forward step (trainer side)::

    out = mtp_forward(model, tokens, position_ids, attention_mask, labels, loss_mask)
    losses = mtp_depth_losses(out.mtp_hidden, labels, loss_mask, out.output_weight, None, cfg)
    output = attach_mtp_loss(out.main_output, total_mtp_loss(losses))
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["MTPForwardOutput", "mtp_forward"]

_REQUIRED_ATTRIBUTES = ("mtp", "mtp_process", "post_process", "output_layer",
                        "compute_language_model_loss", "share_embeddings_and_output_weights",
                        "shared_embedding_or_output_weight", "config")
"""What :func:`mtp_forward` uses on the ``GPTModel`` (0.16 and 0.19 both have all of them)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MTPForwardOutput:
    """What one :func:`mtp_forward` call returns."""

    main_output: torch.Tensor
    """What ``GPTModel`` returns for the main model: per-token cross-entropy ``[b, s]``
    (float32) when ``labels`` is given, else logits ``[b, s, V / tp]``. Carries the graph;
    put the MTP loss on it with ``mtp_loss.attach_mtp_loss``."""
    mtp_hidden: list[torch.Tensor]
    """``D`` tensors ``[s, b, h]`` (Megatron's layout, this rank's CP shard; the sequence
    parallel shard when sequence parallelism is on), the output of MTP depth ``k`` after its
    final norm and before the output layer, depth 1 first. Views of the block's output;
    carry the graph."""
    output_weight: torch.Tensor
    """The output layer's weight as the model applies it (the embedding when tied), to
    pass to ``mtp_loss.mtp_depth_losses`` (which detaches it). ``GPTModel``'s output
    layer has no bias."""


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` inside Megatron's wrappers (DDP, Float16Module: ``.module``)."""
    inner = model
    while not hasattr(inner, "mtp") and isinstance(getattr(inner, "module", None),
                                                   torch.nn.Module):
        inner = inner.module
    return inner


def _check_model(model: torch.nn.Module) -> int:
    """The number of MTP depths; raises when the model lacks what this module uses."""
    missing = [name for name in _REQUIRED_ATTRIBUTES if not hasattr(model, name)]
    if missing:
        raise RuntimeError(f"mtp_forward: {type(model).__name__} lacks {missing}; expected "
                           "megatron-core's GPTModel built with an mtp_block_spec")
    num_depths = getattr(model.config, "mtp_num_layers", None) or 0
    if not model.mtp_process or num_depths < 1:
        raise ValueError("mtp_forward: the model has no MTP block on this stage "
                         f"(mtp_process={model.mtp_process}, mtp_num_layers={num_depths})")
    if not model.post_process:
        raise ValueError("mtp_forward: this pipeline stage has no output layer "
                         "(post_process=False); call the model directly on it")
    if getattr(model.config, "use_mup", False) and not hasattr(model, "_scale_logits"):
        raise RuntimeError("mtp_forward: config.use_mup is set but the model has no "
                           "_scale_logits to apply it with")
    return num_depths


@contextmanager
def _post_process_off(model: torch.nn.Module) -> Iterator[None]:
    """``GPTModel._postprocess`` returns the MTP block's output while this is held."""
    model.post_process = False
    try:
        yield
    finally:
        model.post_process = True


def _stacked_mtp_output(captured: list[tuple[Any, Any]], returned: Any,
                        num_depths: int) -> torch.Tensor:
    """The block's output if it is the layout this module knows, else RuntimeError."""
    if len(captured) != 1:
        raise RuntimeError(f"mtp_forward: the MTP block ran {len(captured)} times in one "
                           "forward, expected once (inference mode or CUDA graphs skip the "
                           "module call; neither is supported here)")
    block_input, block_output = captured[0]
    if returned is not block_output:
        raise RuntimeError("mtp_forward: GPTModel.forward with post_process=False did not "
                           "return the MTP block's output; this megatron-core's "
                           "_postprocess no longer returns before its MTP loss")
    if not isinstance(block_output, torch.Tensor) or block_output.dim() != 3:
        raise RuntimeError("mtp_forward: the MTP block returned "
                           f"{type(block_output).__name__}, expected one [(1 + D) * s, b, h] "
                           "tensor stacking [main; depth 1; ...; depth D] on dim 0")
    main_len = block_input.size(0) if isinstance(block_input, torch.Tensor) else None
    if main_len is None or block_output.size(0) != (1 + num_depths) * main_len:
        raise RuntimeError(f"mtp_forward: the MTP block returned {tuple(block_output.shape)} "
                           f"for hidden_states of {main_len} positions; expected "
                           f"{1 + num_depths} x that many on dim 0 ([main; depth 1; ...; "
                           f"depth {num_depths}])")
    return block_output


def mtp_forward(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None, labels: torch.Tensor | None,
                loss_mask: torch.Tensor | None, packed_seq_params: Any = None
                ) -> MTPForwardOutput:
    """Runs the model once; Megatron's own MTP loss is not computed (module docstring).

    Not re-entrant for the same model (it switches ``post_process`` off for the call).

    Args:
        model: megatron-core's ``GPTModel`` with an MTP block, on the stage that holds the
            output layer; a Megatron DDP / Float16Module wrapper is looked through.
            Float16Module's output cast is then skipped: the per-token loss is float32
            anyway, logits stay in the model's dtype.
        input_ids: ``[b, s]`` token ids, as for ``GPTModel.forward``.
        position_ids: ``[b, s]``.
        attention_mask: as for ``GPTModel.forward`` (None with packed sequences).
        labels: ``[b, s]`` next-token labels for the main loss, or None for logits. Unlike
            ``GPTModel`` on 0.16 (crash) and 0.19 (MTP loss from ``input_ids``), None is
            fine here: the MTP part does not depend on it.
        loss_mask: passed to ``GPTModel.forward``, which reads it only for its own MTP
            loss; give the same mask to ``mtp_depth_losses``.
        packed_seq_params: Megatron's ``PackedSeqParams`` for THD input, or None.

    Returns:
        The main output, the MTP hidden states per depth and the output weight.

    Raises:
        ValueError: the model has no MTP block or no output layer on this stage.
        RuntimeError: the model or its MTP block does not behave as on megatron-core
            0.16-0.19 (the message names what is missing).
    """
    gpt = _unwrap(model)
    num_depths = _check_model(gpt)
    captured: list[tuple[Any, Any]] = []

    def hook(_module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        block_input = kwargs.get("hidden_states", args[2] if len(args) > 2 else None)
        captured.append((block_input, output))

    handle = gpt.mtp.register_forward_hook(hook, with_kwargs=True)
    try:
        with _post_process_off(gpt):
            returned = gpt(input_ids=input_ids, position_ids=position_ids,
                           attention_mask=attention_mask, labels=labels, loss_mask=loss_mask,
                           packed_seq_params=packed_seq_params)
    finally:
        handle.remove()
    stacked = _stacked_mtp_output(captured, returned, num_depths)
    main_hidden, *mtp_hidden = torch.chunk(stacked, 1 + num_depths, dim=0)

    # The rest of GPTModel._postprocess for training: output layer, (MuP) scaling, loss.
    output_weight = (gpt.shared_embedding_or_output_weight()
                     if gpt.share_embeddings_and_output_weights else None)
    logits, _ = gpt.output_layer(main_hidden, weight=output_weight)
    scale_logits = getattr(gpt, "_scale_logits", None)  # 0.19: MuP output scaling
    if scale_logits is not None:
        logits = scale_logits(logits)
    if labels is None:
        main_output = logits.transpose(0, 1).contiguous()
    else:
        main_output = gpt.compute_language_model_loss(labels, logits)
    return MTPForwardOutput(main_output=main_output, mtp_hidden=mtp_hidden,
                            output_weight=(output_weight if output_weight is not None
                                           else gpt.output_layer.weight))
