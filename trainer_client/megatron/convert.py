"""Hugging Face checkpoint tensors <-> megatron-core ``GPTModel`` tensors, TP-sharded.

Runs in the trainer: :func:`hf_to_megatron` / :func:`load_hf_state` once at start-up
on every rank, :func:`export_hf_weights` after every optimizer step to feed the
weight push (``trainer_client.push``). Only the export talks to other processes: it
all-gathers each tensor's shards over the TP group it is given.

Which tensors correspond is the architecture's business (``model.ARCHITECTURES``,
a list of ``TensorMap``); this module applies the layouts. Every transform is pure
indexing and concatenation, so HF -> Megatron -> HF is bit-exact and keeps dtypes.

Layouts, as megatron-core 0.16.1 reads its tensors:

- QKV: ``SelfAttention.get_query_key_value_tensors`` views the fused output as
  ``[num_query_groups, (heads_per_group + 2) * head_dim]`` and splits each group into
  ``[q heads, k, v]``; TP splits the fused rows on dim 0 (when TP exceeds the number
  of groups Megatron all-gathers and picks its slice, which this same layout serves).
- fc1: ``MLP``'s GLU does ``chunk(2, dim=-1)`` on each rank's local output, so rank r
  holds ``[gate_r; up_r]``, not a slice of ``[gate; up]``.
- eh_proj: ``MultiTokenPredictionLayer._concat_embeddings`` computes
  ``eh_proj(cat((enorm(embedding), hnorm(hidden)), -1))``; MiMo's ``input_proj`` (as
  vLLM's ``MiMoMultiTokenPredictorLayer`` runs it) reads ``cat([hidden, embedding])``.
  The input halves (dim 1) are swapped; TP then splits the output rows (dim 0).

Exported names come in checkpoint module order: embedding, decoder layers (attention,
MLP, norms), final norm, MTP layers, lm_head; :func:`hf_tensor_shapes` lists them
ahead of time so a pusher can announce them before the gather streams.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from trainer_client.megatron.model import Layout, TensorMap, architecture_spec

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = [
    "export_hf_weights",
    "hf_tensor_shapes",
    "hf_to_megatron",
    "load_hf_state",
    "megatron_to_hf",
]

_SPLIT_DIM = {Layout.COLUMN: 0, Layout.ROW: 1, Layout.QKV: 0, Layout.GATE_UP: 0,
              Layout.SWAP_INPUT_HALVES: 0}
"""The dim each layout's Megatron tensor is split on across TP ranks."""


def _attention_shape(hf_config: Mapping[str, Any]) -> tuple[int, int, int]:
    """(query heads, query groups, head dim), as the architecture gives them to Megatron."""
    kwargs = architecture_spec(hf_config).config_kwargs(hf_config)
    return kwargs["num_attention_heads"], kwargs["num_query_groups"], kwargs["kv_channels"]


def _chunk(tensor: torch.Tensor, dim: int, tp_size: int, what: str) -> tuple[torch.Tensor, ...]:
    if tensor.size(dim) % tp_size:
        raise ValueError(f"{what}: dim {dim} of size {tensor.size(dim)} does not split into "
                         f"{tp_size} TP shards")
    return tensor.chunk(tp_size, dim=dim)


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              shape: tuple[int, int, int]) -> torch.Tensor:
    num_heads, num_groups, head_dim = shape
    rows = (num_heads * head_dim, num_groups * head_dim, num_groups * head_dim)
    if tuple(t.size(0) for t in (q, k, v)) != rows:
        raise ValueError(f"q/k/v have {[t.size(0) for t in (q, k, v)]} rows; the config "
                         f"({num_heads} heads, {num_groups} groups, head_dim {head_dim}) "
                         f"needs {list(rows)}")
    per_group = [t.reshape(num_groups, -1, *t.shape[1:]) for t in (q, k, v)]
    return torch.cat(per_group, dim=1).reshape(-1, *q.shape[1:])


def _unfuse_qkv(qkv: torch.Tensor, shape: tuple[int, int, int]) -> tuple[torch.Tensor, ...]:
    num_heads, num_groups, head_dim = shape
    grouped = qkv.reshape(num_groups, -1, *qkv.shape[1:])
    sizes = [num_heads // num_groups * head_dim, head_dim, head_dim]
    return tuple(t.reshape(-1, *qkv.shape[1:]).contiguous()
                 for t in grouped.split(sizes, dim=1))


def _swap_input_halves(weight: torch.Tensor) -> torch.Tensor:
    first, second = weight.chunk(2, dim=1)
    return torch.cat([second, first], dim=1)


def _to_megatron(tmap: TensorMap, hf: Sequence[torch.Tensor], tp_rank: int, tp_size: int,
                 attention: tuple[int, int, int]) -> torch.Tensor:
    """The TP shard of one Megatron tensor on ``tp_rank``."""
    if tmap.layout is Layout.REPLICATED:
        return hf[0].clone()
    if tmap.layout is Layout.GATE_UP:
        gate, up = (_chunk(t, 0, tp_size, tmap.megatron)[tp_rank] for t in hf)
        return torch.cat([gate, up], dim=0)
    if tmap.layout is Layout.QKV:
        full = _fuse_qkv(*hf, attention)
    elif tmap.layout is Layout.SWAP_INPUT_HALVES:
        full = _swap_input_halves(hf[0])
    else:
        full = hf[0]
    shard = _chunk(full, _SPLIT_DIM[tmap.layout], tp_size, tmap.megatron)[tp_rank]
    return shard.clone(memory_format=torch.contiguous_format)


def _to_hf(tmap: TensorMap, shards: Sequence[torch.Tensor],
           attention: tuple[int, int, int]) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint tensors of one Megatron tensor, from its shards in TP rank order."""
    if tmap.layout is Layout.REPLICATED:
        return [(tmap.hf[0], shards[0])]
    if tmap.layout is Layout.GATE_UP:
        halves = [shard.chunk(2, dim=0) for shard in shards]
        gate = torch.cat([h[0] for h in halves], dim=0)
        up = torch.cat([h[1] for h in halves], dim=0)
        return list(zip(tmap.hf, (gate, up), strict=True))
    full = torch.cat(list(shards), dim=_SPLIT_DIM[tmap.layout])
    if tmap.layout is Layout.QKV:
        return list(zip(tmap.hf, _unfuse_qkv(full, attention), strict=True))
    if tmap.layout is Layout.SWAP_INPUT_HALVES:
        full = _swap_input_halves(full)
    return [(tmap.hf[0], full)]


def hf_tensor_shapes(model: torch.nn.Module, hf_config: Mapping[str, Any],
                     tp_size: int = 1) -> dict[str, tuple[int, ...]]:
    """Names and shapes :func:`export_hf_weights` will yield, in its order, without a gather.

    Lets a pusher announce the tensors before the export streams them. Derived from
    this rank's parameter shapes by the same code the export runs (on meta tensors).

    Args:
        model: this rank's ``GPTModel``.
        hf_config: the checkpoint's config.json.
        tp_size: TP group size.
    """
    attention = _attention_shape(hf_config)
    params = model.state_dict()
    shapes: dict[str, tuple[int, ...]] = {}
    for tmap in architecture_spec(hf_config).tensor_maps(hf_config):
        local = torch.empty(params[tmap.megatron].shape, device="meta")
        num_shards = 1 if tmap.layout is Layout.REPLICATED else tp_size
        shapes.update((name, tuple(t.shape))
                      for name, t in _to_hf(tmap, [local] * num_shards, attention))
    return shapes


def hf_to_megatron(hf_state: Mapping[str, torch.Tensor], hf_config: Mapping[str, Any],
                   tp_rank: int = 0, tp_size: int = 1) -> dict[str, torch.Tensor]:
    """Converts a checkpoint into one TP rank's ``GPTModel`` state dict.

    The result has every parameter of the model (no ``_extra_state`` entries; use
    :func:`load_hf_state` to load it strictly), in the checkpoint's dtypes, as new
    tensors that share no memory with ``hf_state``.

    Args:
        hf_state: checkpoint tensors by HF name (e.g. ``safetensors.torch.load_file``).
        hf_config: the checkpoint's config.json.
        tp_rank: this rank in the TP group.
        tp_size: TP group size.

    Raises:
        ValueError: unsupported architecture, a bad rank, a dimension TP cannot split,
            or checkpoint tensors missing or left over.
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank: {tp_rank} is not in [0, {tp_size})")
    attention = _attention_shape(hf_config)  # validates the config first
    tensor_maps = architecture_spec(hf_config).tensor_maps(hf_config)
    expected = {name for tmap in tensor_maps for name in tmap.hf}
    if missing := sorted(expected - hf_state.keys()):
        raise ValueError(f"hf_state: missing {len(missing)} tensors, e.g. {missing[:3]}")
    if extra := sorted(hf_state.keys() - expected):
        raise ValueError(f"hf_state: {len(extra)} tensors the model has no place for, "
                         f"e.g. {extra[:3]}")
    return {tmap.megatron: _to_megatron(tmap, [hf_state[name] for name in tmap.hf], tp_rank,
                                        tp_size, attention)
            for tmap in tensor_maps}


def megatron_to_hf(mcore_state_per_rank: Sequence[Mapping[str, torch.Tensor]],
                   hf_config: Mapping[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """Gathers per-rank ``GPTModel`` state dicts into checkpoint tensors.

    Args:
        mcore_state_per_rank: one state dict per TP rank, in rank order (extra keys
            such as ``_extra_state`` are ignored).
        hf_config: the checkpoint's config.json.

    Yields:
        ``(hf_name, tensor)`` in checkpoint module order (see :func:`hf_tensor_shapes`);
        a replicated tensor (norm weight) is rank 0's tensor itself, not a copy.

    Raises:
        ValueError: unsupported architecture, or no state dicts.
        KeyError: a Megatron tensor is missing from a rank's state dict.
    """
    if not mcore_state_per_rank:
        raise ValueError("mcore_state_per_rank: empty")
    attention = _attention_shape(hf_config)
    for tmap in architecture_spec(hf_config).tensor_maps(hf_config):
        yield from _to_hf(tmap, [state[tmap.megatron] for state in mcore_state_per_rank],
                          attention)


def load_hf_state(model: torch.nn.Module, hf_state: Mapping[str, torch.Tensor],
                  hf_config: Mapping[str, Any], *, tp_rank: int = 0, tp_size: int = 1) -> None:
    """Loads checkpoint tensors into this rank's ``GPTModel`` with ``strict=True``.

    Megatron's ``_extra_state`` entries (FP8 metadata, ``None`` for the local spec)
    are taken from the model itself; every parameter must come from the checkpoint.

    Raises:
        ValueError: as :func:`hf_to_megatron`.
        RuntimeError: names or shapes do not match the model (from ``load_state_dict``).
    """
    state: dict[str, Any] = hf_to_megatron(hf_state, hf_config, tp_rank, tp_size)
    state.update({name: value for name, value in model.state_dict().items()
                  if name.endswith("._extra_state")})
    model.load_state_dict(state, strict=True)


def _checkpoint_dtype(hf_config: Mapping[str, Any]) -> torch.dtype | None:
    name = hf_config.get("torch_dtype")
    if name is None:
        return None
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"hf_config: torch_dtype {name!r} is not a torch dtype")
    return dtype


def export_dtype(model: torch.nn.Module, hf_config: Mapping[str, Any]) -> torch.dtype:
    """The dtype :func:`export_hf_weights` yields by default: the config's ``torch_dtype``,
    else the output layer's (the model's parameter dtype)."""
    return _checkpoint_dtype(hf_config) or model.output_layer.weight.dtype


def export_hf_weights(model: torch.nn.Module, hf_config: Mapping[str, Any],
                      tp_group: dist.ProcessGroup | None = None, *,
                      dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Streams the live model's weights under checkpoint names, one tensor at a time.

    Every rank of ``tp_group`` must iterate the whole generator (each tensor is one
    all_gather); all of them get the full tensors. Pass the unwrapped ``GPTModel``
    (not a DDP / Float16Module wrapper), whose names match the architecture's map.

    Args:
        model: this rank's ``GPTModel``.
        hf_config: the checkpoint's config.json.
        tp_group: the TP group (e.g. ``parallel_state.get_tensor_model_parallel_group()``);
            ``None`` means TP 1.
        dtype: dtype of the yielded tensors; defaults to the config's ``torch_dtype``
            (what the rollout service validates a push against), or the model's own
            dtype when the config has none. Shards are cast before the gather.

    Yields:
        ``(hf_name, tensor)`` in checkpoint module order (see :func:`hf_tensor_shapes`),
        on the model's device, detached. A tensor that needs no gather, cast or
        reshuffle (a norm weight in the model's dtype) is the parameter itself: copy
        it before the next optimizer step if you keep it.
    """
    import torch.distributed as dist

    dtype = dtype or _checkpoint_dtype(hf_config)
    tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
    attention = _attention_shape(hf_config)
    params = model.state_dict()
    for tmap in architecture_spec(hf_config).tensor_maps(hf_config):
        local = params[tmap.megatron].detach()
        local = local if dtype is None else local.to(dtype)
        if tmap.layout is Layout.REPLICATED or tp_size == 1:
            shards = [local]
        else:
            local = local.contiguous()
            shards = [torch.empty_like(local) for _ in range(tp_size)]
            dist.all_gather(shards, local, group=tp_group)
        yield from _to_hf(tmap, shards, attention)
