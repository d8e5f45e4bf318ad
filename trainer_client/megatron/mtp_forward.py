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
path. Both versions' ``_postprocess`` start with the MTP block, then return on a stage
without the output layer::

    if mtp_in_postprocess:                 # GPTModel.forward passes self.mtp_process
        hidden_states = self.mtp(input_ids, position_ids, hidden_states, attention_mask,
                                 rotary_pos_emb, ..., packed_seq_params, ...,
                                 embedding=self.embedding)
    if not self.post_process:
        return hidden_states
    ...MTP loss (inline or process_mtp_loss), output layer, main loss...

So the forward runs in two calls:

1. The trunk: ``GPTModel.forward`` with ``mtp_process`` and ``post_process`` switched off
   for the call returns the decoder's output (the main hidden states, after the final
   norm). A forward hook on ``model.decoder`` checks that what comes back *is* the
   decoder's output (the one feature this relies on, checked on every call rather than
   by version) and records what the decoder was given (attention mask, rotary embeddings,
   ``packed_seq_params``, ...): ``_postprocess`` hands the MTP block the same objects.
2. The MTP block, called here as ``_postprocess`` calls it, except for what it consumes
   from the trunk when ``detach_trunk`` is set: the main hidden states detached, and an
   embedding that runs without gradient. That is the cut slime makes (and verl's
   ``detach_encoder``, 0.19's ``mtp_detach_heads`` inside the block): the MTP loss then
   trains the MTP layers only. The main output is computed from the decoder's output
   itself, never from the block's copy of it, so the main loss still trains the trunk.

The main output is completed here as ``_postprocess`` completes it: output layer, 0.19's
MuP logit scaling where the model has it, ``compute_language_model_loss``. No
full-vocabulary logits are computed for the MTP depths and no Megatron MTP loss graph is
kept alive; Megatron's ``MTPLossLoggingHelper`` records nothing (log with
``mtp_loss.reduce_for_logging`` instead). Megatron's ``mtp_loss_scaling_factor`` plays no
part: scale with ``MTPLossConfig.scaling_factor``.

Activation recompute of the MTP layers (``recompute_granularity='full'``,
``recompute_method='uniform'``) works with the padded (BSHD) layout; with packed (THD)
sequences megatron-core before 0.18 crashes in it (``_checkpointed_forward`` hands
``PackedSeqParams`` to ``save_for_backward``; NVIDIA/Megatron-LM#3457), so
:func:`mtp_forward` refuses that combination up front (:func:`mtp_recompute_breaks_thd`).

Typical use in a forward step (trainer side)::

    out = mtp_forward(model, tokens, position_ids, attention_mask, labels, loss_mask,
                      detach_trunk=cfg.detach_trunk)
    losses = mtp_depth_losses(out.mtp_hidden, labels, loss_mask, out.output_weight, None, cfg)
    output = attach_mtp_loss(out.main_output, total_mtp_loss(losses))
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["MTPForwardOutput", "mtp_forward", "mtp_recompute_breaks_thd"]

_REQUIRED_ATTRIBUTES = ("decoder", "embedding", "mtp", "mtp_process", "post_process",
                        "output_layer", "compute_language_model_loss",
                        "share_embeddings_and_output_weights",
                        "shared_embedding_or_output_weight", "config")
"""What :func:`mtp_forward` uses on the ``GPTModel`` (0.16 and 0.19 both have all of them)."""

_DECODER_INPUTS_FOR_MTP = ("attention_mask", "rotary_pos_emb", "rotary_pos_cos",
                           "rotary_pos_sin", "packed_seq_params", "sequence_len_offset",
                           "padding_mask")
"""What ``GPTModel._postprocess`` hands the MTP block besides ids, hidden states and the
embedding: the objects the decoder got (``padding_mask`` from 0.19 on)."""


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
    carry the graph (into the trunk too unless ``detach_trunk``)."""
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


def _check_model(model: torch.nn.Module, detach_trunk: bool) -> int:
    """The number of MTP depths; raises when the model lacks what this module uses."""
    missing = [name for name in _REQUIRED_ATTRIBUTES if not hasattr(model, name)]
    if missing:
        raise RuntimeError(f"mtp_forward: {type(model).__name__} lacks {missing}; expected "
                           "megatron-core's GPTModel built with an mtp_block_spec")
    if not isinstance(detach_trunk, bool):
        raise ValueError(f"mtp_forward: detach_trunk must be a bool, got {detach_trunk!r}")
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
    if getattr(model.config, "mtp_detach_heads", False) and not detach_trunk:
        raise ValueError("mtp_forward: detach_trunk=False, but the model's "
                         "TransformerConfig.mtp_detach_heads=True detaches the trunk inside "
                         "the MTP block anyway; pass detach_trunk=True or build the model "
                         "without mtp_detach_heads")
    return num_depths


@functools.cache
def mtp_recompute_breaks_thd() -> bool:
    """Whether this megatron-core's MTP activation recompute crashes with packed sequences.

    0.16 and 0.17's ``MultiTokenPredictionLayer._checkpointed_forward(self, forward_func,
    *args, **kwargs)`` passes every keyword argument, ``PackedSeqParams`` included, to
    ``tensor_parallel.checkpoint``, whose ``save_for_backward`` takes tensors only; 0.18
    rewrote it with tensor arguments only (NVIDIA/Megatron-LM#3457). Told apart by that
    signature, not by version.
    """
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

    params = list(inspect.signature(MultiTokenPredictionLayer._checkpointed_forward).parameters)
    return params[1:2] == ["forward_func"]


def _check_recompute(model: torch.nn.Module, packed_seq_params: Any) -> None:
    """Refuse MTP recompute with packed sequences where megatron-core would crash in it."""
    config = model.config
    is_mtp_recomputed = (model.training
                         and getattr(config, "recompute_granularity", None) == "full"
                         and getattr(config, "recompute_method", None) == "uniform")
    if packed_seq_params is not None and is_mtp_recomputed and mtp_recompute_breaks_thd():
        raise ValueError(
            "mtp_forward: activation recompute of the MTP layers (TransformerConfig "
            "recompute_granularity='full' with recompute_method='uniform') crashes with "
            "packed (THD) sequences on this megatron-core: MultiTokenPredictionLayer."
            "_checkpointed_forward hands PackedSeqParams to save_for_backward (fixed in "
            "0.18, NVIDIA/Megatron-LM#3457). Use the padded (BSHD) layout, "
            "recompute_granularity='selective' or None, recompute_method='block' (Megatron "
            "then skips recompute for the MTP layers), or megatron-core >= 0.18")


@contextmanager
def _trunk_only(model: torch.nn.Module) -> Iterator[None]:
    """``GPTModel.forward`` returns the decoder's output while this is held."""
    model.mtp_process, model.post_process = False, False
    try:
        yield
    finally:
        model.mtp_process, model.post_process = True, True


def _run_trunk(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
               attention_mask: torch.Tensor | None, packed_seq_params: Any
               ) -> tuple[torch.Tensor, dict[str, Any]]:
    """The decoder's output ``[s, b, h]`` and what the decoder was given for the MTP block."""
    captured: list[tuple[dict[str, Any], Any]] = []

    def hook(_module: torch.nn.Module, _args: tuple, kwargs: dict, output: Any) -> None:
        captured.append((kwargs, output))

    handle = model.decoder.register_forward_hook(hook, with_kwargs=True)
    try:
        with _trunk_only(model):
            returned = model(input_ids=input_ids, position_ids=position_ids,
                             attention_mask=attention_mask, packed_seq_params=packed_seq_params)
    finally:
        handle.remove()
    if len(captured) != 1:
        raise RuntimeError(f"mtp_forward: the decoder ran {len(captured)} times in one "
                           "forward, expected once (inference mode or CUDA graphs skip the "
                           "module call; neither is supported here)")
    decoder_kwargs, decoder_output = captured[0]
    if returned is not decoder_output or not isinstance(returned, torch.Tensor) \
            or returned.dim() != 3:
        raise RuntimeError("mtp_forward: GPTModel.forward with mtp_process and post_process "
                           "off did not return the decoder's [s, b, h] output; this "
                           "megatron-core's _postprocess no longer returns it unchanged")
    return returned, {name: decoder_kwargs[name] for name in _DECODER_INPUTS_FOR_MTP
                      if name in decoder_kwargs}


def _embedding_without_grad(embedding: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """``embedding`` as the MTP layer calls it, run without building a graph (= detached)."""
    def embed(*args: Any, **kwargs: Any) -> torch.Tensor:
        with torch.no_grad():
            return embedding(*args, **kwargs)
    return embed


def _run_mtp_block(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                   main_hidden: torch.Tensor, block_inputs: dict[str, Any], num_depths: int,
                   detach_trunk: bool) -> list[torch.Tensor]:
    """The MTP block's output per depth, ``[s, b, h]`` each, depth 1 first."""
    accepted = inspect.signature(model.mtp.forward).parameters
    dropped = [name for name, value in block_inputs.items()
               if name not in accepted and value is not None]
    if dropped:
        raise RuntimeError(f"mtp_forward: the decoder got {dropped}, which this "
                           "megatron-core's MultiTokenPredictionBlock.forward does not take")
    kwargs = {name: value for name, value in block_inputs.items() if name in accepted}
    if detach_trunk:
        # A leaf that requires grad, not a plain detach: megatron-core 0.16's MTP recompute
        # (a reentrant autograd.Function) returns an output without grad when none of its
        # inputs requires grad, and the MTP layers would silently get none. The leaf's
        # gradient stops here; 0.19's block does the same for mtp_detach_heads.
        hidden = main_hidden.detach().requires_grad_()
        embedding: Callable[..., torch.Tensor] = _embedding_without_grad(model.embedding)
    else:
        hidden, embedding = main_hidden, model.embedding
    stacked = model.mtp(input_ids=input_ids, position_ids=position_ids, hidden_states=hidden,
                        embedding=embedding, **kwargs)
    main_len = main_hidden.size(0)
    if not isinstance(stacked, torch.Tensor) or stacked.dim() != 3 \
            or stacked.size(0) != (1 + num_depths) * main_len:
        shape = tuple(stacked.shape) if isinstance(stacked, torch.Tensor) else type(stacked)
        raise RuntimeError(f"mtp_forward: the MTP block returned {shape} for hidden_states "
                           f"of {main_len} positions; expected one tensor stacking "
                           f"[main; depth 1; ...; depth {num_depths}] on dim 0")
    return list(torch.chunk(stacked, 1 + num_depths, dim=0)[1:])


def mtp_forward(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None, labels: torch.Tensor | None,
                loss_mask: torch.Tensor | None = None, packed_seq_params: Any = None, *,
                detach_trunk: bool) -> MTPForwardOutput:
    """Runs the model once; Megatron's own MTP loss is not computed (module docstring).

    Not re-entrant for the same model (it switches ``mtp_process`` and ``post_process``
    off for the trunk's call).

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
        loss_mask: unused: ``GPTModel`` reads it only for its own MTP loss, which is not
            run. Accepted so that one batch dict feeds ``model(**batch)`` and this alike;
            give the mask to ``mtp_depth_losses``.
        packed_seq_params: Megatron's ``PackedSeqParams`` for THD input (build it with
            ``megatron.packed.packed_seq_params``), or None.
        detach_trunk: ``MTPLossConfig.detach_trunk``: feed the MTP block a detached copy
            of the main hidden states and an embedding without gradient, so that the MTP
            loss trains the MTP layers only. Required: the choice belongs to the config.

    Returns:
        The main output, the MTP hidden states per depth and the output weight.

    Raises:
        ValueError: the model has no MTP block or no output layer on this stage;
            ``detach_trunk`` is not a bool or contradicts the model's
            ``mtp_detach_heads``; MTP recompute with packed sequences on a megatron-core
            that crashes in it (the message names the TransformerConfig options).
        RuntimeError: the model or its MTP block does not behave as on megatron-core
            0.16-0.19 (the message names what is missing).
    """
    del loss_mask
    gpt = _unwrap(model)
    num_depths = _check_model(gpt, detach_trunk)
    _check_recompute(gpt, packed_seq_params)
    main_hidden, block_inputs = _run_trunk(gpt, input_ids, position_ids, attention_mask,
                                           packed_seq_params)
    mtp_hidden = _run_mtp_block(gpt, input_ids, position_ids, main_hidden, block_inputs,
                                num_depths, detach_trunk)

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
