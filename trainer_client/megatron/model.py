"""Builds a megatron-core ``GPTModel`` with an MTP block from a Hugging Face config.

Runs in each trainer rank (and in the CPU tests and local demo). No communication
of its own beyond what megatron-core's tensor-parallel layers do over the groups
``parallel_state`` holds; :func:`init_parallel_cpu` sets those up over gloo.

Architectures are looked up by the checkpoint's ``architectures[0]`` in
:data:`ARCHITECTURES`. Each entry says how to fill a ``TransformerConfig`` and the
``GPTModel`` arguments, and how every Megatron tensor corresponds to checkpoint
tensors (:class:`TensorMap`, interpreted by ``convert.py``). The local spec (no
Transformer Engine) is what the converter maps; the Transformer Engine spec is built on
request for what only it runs (packed THD attention).

megatron-core is imported inside the functions that need it, so ``convert.py``
(which reads the registry) works without paying megatron-core's import time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

__all__ = [
    "ARCHITECTURES",
    "ArchitectureSpec",
    "Layout",
    "TensorMap",
    "architecture_spec",
    "build_gpt_mtp_model",
    "init_parallel_cpu",
]


class Layout(enum.Enum):
    """How checkpoint tensors become one Megatron tensor and how TP shards it."""

    REPLICATED = "replicated"
    """One tensor, the same on every TP rank (norm weights)."""
    COLUMN = "column"
    """One tensor split on dim 0 (column-parallel linears, vocab-parallel embedding)."""
    ROW = "row"
    """One tensor split on dim 1 (row-parallel linears)."""
    QKV = "qkv"
    """(q, k, v) fused per query group ``[q heads of group g, k_g, v_g]`` for every g,
    then split on dim 0. Works for weights and biases."""
    GATE_UP = "gate_up"
    """(gate, up): each is split on dim 0, and rank r holds ``[gate_r; up_r]`` (Megatron's
    GLU takes ``chunk(2, dim=-1)`` of its local fc1 output)."""
    SWAP_INPUT_HALVES = "swap_input_halves"
    """One ``[out, 2 * in]`` tensor whose two input halves are swapped, then split on
    dim 0: MiMo's ``input_proj`` reads ``cat([hidden, embedding])`` where Megatron's
    ``eh_proj`` reads ``cat([embedding, hidden])``."""


@dataclass(frozen=True, slots=True)
class TensorMap:
    """One Megatron tensor and the checkpoint tensors it is made of."""

    megatron: str
    """Name in ``GPTModel.state_dict()``."""
    hf: tuple[str, ...]
    """Checkpoint names, in the order the layout expects them."""
    layout: Layout
    """How they are fused and sharded."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ArchitectureSpec:
    """What differs between checkpoint architectures; the rest is shared code."""

    config_kwargs: Callable[[Mapping[str, Any]], dict[str, Any]]
    """HF config -> ``TransformerConfig`` keyword arguments describing the architecture
    (not parallelism or dtype). ``convert.py`` reads the attention shape from them."""
    model_kwargs: Callable[[Mapping[str, Any]], dict[str, Any]]
    """HF config -> ``GPTModel`` keyword arguments (vocabulary, rotary, tying)."""
    tensor_maps: Callable[[Mapping[str, Any]], list[TensorMap]]
    """HF config -> every tensor of the model, in checkpoint (HF module) order."""


# --------------------------------------------------------------------------- MiMo

def _require(hf_config: Mapping[str, Any], key: str) -> Any:
    if key not in hf_config:
        raise ValueError(f"hf_config: missing {key!r}")
    return hf_config[key]


def _mimo_config_kwargs(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen2 body: RMSNorm, SwiGLU, q/k/v bias only, rotary, GQA; MiMo's MTP layers."""
    if hf_config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hf_config: hidden_act {hf_config['hidden_act']!r} is not supported "
                         "(MiMo uses 'silu')")
    if hf_config.get("rope_scaling"):
        raise ValueError("hf_config: rope_scaling is not supported")
    if hf_config.get("use_sliding_window"):
        raise ValueError("hf_config: sliding-window attention is not supported")
    num_mtp_layers = int(hf_config.get("num_nextn_predict_layers") or 0)
    if num_mtp_layers < 1:
        raise ValueError("hf_config: num_nextn_predict_layers must be >= 1 for an MTP model")
    hidden_size = int(_require(hf_config, "hidden_size"))
    num_heads = int(_require(hf_config, "num_attention_heads"))
    return {
        "num_layers": int(_require(hf_config, "num_hidden_layers")),
        "hidden_size": hidden_size,
        "ffn_hidden_size": int(_require(hf_config, "intermediate_size")),
        "num_attention_heads": num_heads,
        "num_query_groups": int(hf_config.get("num_key_value_heads") or num_heads),
        "kv_channels": int(hf_config.get("head_dim") or hidden_size // num_heads),
        "normalization": "RMSNorm",
        "layernorm_epsilon": float(_require(hf_config, "rms_norm_eps")),
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": False,
        "add_qkv_bias": True,
        "hidden_dropout": 0.0,
        "attention_dropout": float(hf_config.get("attention_dropout", 0.0)),
        "mtp_num_layers": num_mtp_layers,
    }


def _mimo_model_kwargs(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    if hf_config.get("tie_word_embeddings", False):
        raise ValueError("hf_config: tied embeddings are not supported (MiMo unties them)")
    return {
        "vocab_size": int(_require(hf_config, "vocab_size")),
        "max_sequence_length": int(_require(hf_config, "max_position_embeddings")),
        "position_embedding_type": "rope",
        "rotary_base": float(hf_config.get("rope_theta", 10000.0)),
        "share_embeddings_and_output_weights": False,
    }


def _qwen2_layer_maps(hf: str, mc: str) -> list[TensorMap]:
    """One Qwen2 decoder layer: HF prefix ``hf`` -> Megatron ``TransformerLayer`` prefix ``mc``."""
    attn = f"{hf}self_attn."
    return [
        TensorMap(f"{mc}self_attention.linear_qkv.weight",
                  (f"{attn}q_proj.weight", f"{attn}k_proj.weight", f"{attn}v_proj.weight"),
                  Layout.QKV),
        TensorMap(f"{mc}self_attention.linear_qkv.bias",
                  (f"{attn}q_proj.bias", f"{attn}k_proj.bias", f"{attn}v_proj.bias"), Layout.QKV),
        TensorMap(f"{mc}self_attention.linear_proj.weight", (f"{attn}o_proj.weight",), Layout.ROW),
        TensorMap(f"{mc}mlp.linear_fc1.weight",
                  (f"{hf}mlp.gate_proj.weight", f"{hf}mlp.up_proj.weight"), Layout.GATE_UP),
        TensorMap(f"{mc}mlp.linear_fc2.weight", (f"{hf}mlp.down_proj.weight",), Layout.ROW),
        TensorMap(f"{mc}input_layernorm.weight", (f"{hf}input_layernorm.weight",),
                  Layout.REPLICATED),
        TensorMap(f"{mc}pre_mlp_layernorm.weight", (f"{hf}post_attention_layernorm.weight",),
                  Layout.REPLICATED),
    ]


@functools.cache
def mtp_inner_layer_name() -> str:
    """Attribute of Megatron's MTP layer that holds its decoder layer.

    ``transformer_layer`` in megatron-core 0.16, ``mtp_model_layer`` in 0.19: told
    apart by the fields of ``MultiTokenPredictionLayerSubmodules``, not by version.
    Without megatron-core (pure name conversion) the 0.16 name is used.
    """
    try:
        from megatron.core.transformer.multi_token_prediction import (
            MultiTokenPredictionLayerSubmodules,
        )
    except ImportError:
        return "transformer_layer"
    names = {f.name for f in dataclasses.fields(MultiTokenPredictionLayerSubmodules)}
    for name in ("mtp_model_layer", "transformer_layer"):
        if name in names:
            return name
    raise RuntimeError(f"megatron-core's MultiTokenPredictionLayerSubmodules has neither "
                       f"'mtp_model_layer' nor 'transformer_layer' (fields: {sorted(names)})")


def _mimo_tensor_maps(hf_config: Mapping[str, Any]) -> list[TensorMap]:
    """MiMo checkpoint names (as vLLM's MiMo and MiMoMTP load them) <-> GPTModel names.

    MTP layer i (0-indexed, ``model.mtp_layers.{i}.``) holds a Qwen2 decoder layer's
    tensors directly under its prefix, plus ``token_layernorm`` (Megatron ``enorm``),
    ``hidden_layernorm`` (``hnorm``), ``input_proj`` (``eh_proj``, input halves
    swapped) and ``final_layernorm``. Embedding and lm_head are shared with the main
    model in both.
    """
    maps = [TensorMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",),
                      Layout.COLUMN)]
    for i in range(int(_require(hf_config, "num_hidden_layers"))):
        maps += _qwen2_layer_maps(f"model.layers.{i}.", f"decoder.layers.{i}.")
    maps.append(TensorMap("decoder.final_layernorm.weight", ("model.norm.weight",),
                          Layout.REPLICATED))
    for i in range(int(hf_config.get("num_nextn_predict_layers") or 0)):
        hf, mc = f"model.mtp_layers.{i}.", f"mtp.layers.{i}."
        maps += [
            TensorMap(f"{mc}enorm.weight", (f"{hf}token_layernorm.weight",), Layout.REPLICATED),
            TensorMap(f"{mc}hnorm.weight", (f"{hf}hidden_layernorm.weight",), Layout.REPLICATED),
            TensorMap(f"{mc}eh_proj.weight", (f"{hf}input_proj.weight",),
                      Layout.SWAP_INPUT_HALVES),
        ]
        maps += _qwen2_layer_maps(hf, f"{mc}{mtp_inner_layer_name()}.")
        maps.append(TensorMap(f"{mc}final_layernorm.weight", (f"{hf}final_layernorm.weight",),
                              Layout.REPLICATED))
    maps.append(TensorMap("output_layer.weight", ("lm_head.weight",), Layout.COLUMN))
    return maps


MIMO = ArchitectureSpec(config_kwargs=_mimo_config_kwargs, model_kwargs=_mimo_model_kwargs,
                        tensor_maps=_mimo_tensor_maps)

ARCHITECTURES: dict[str, ArchitectureSpec] = {"MiMoForCausalLM": MIMO}
"""HF ``architectures[0]`` -> spec. DeepSeek-V3 (MLA, MoE, its own MTP names) would add
an entry with its own maps; its ``eh_proj`` already reads ``[embedding, hidden]``, so it
would use ``Layout.COLUMN`` where MiMo needs ``SWAP_INPUT_HALVES``."""


def architecture_spec(hf_config: Mapping[str, Any]) -> ArchitectureSpec:
    """Returns the registry entry for the checkpoint's architecture.

    Raises:
        ValueError: no ``architectures`` in the config, or one that is not registered.
    """
    names = hf_config.get("architectures") or []
    if not names:
        raise ValueError("hf_config: no 'architectures' entry")
    if names[0] not in ARCHITECTURES:
        raise ValueError(f"hf_config: architecture {names[0]!r} is not supported "
                         f"(supported: {sorted(ARCHITECTURES)})")
    return ARCHITECTURES[names[0]]


# --------------------------------------------------------------------------- build

_SET_BY_BUILD = ("tensor_model_parallel_size", "params_dtype", "bf16", "fp16",
                 "use_cpu_initialization")
"""``TransformerConfig`` fields :func:`build_gpt_mtp_model` sets from its own arguments."""


def build_gpt_mtp_model(hf_config: Mapping[str, Any], *, tp_size: int = 1,
                        params_dtype: torch.dtype = torch.float32,
                        transformer_config: Mapping[str, Any] | None = None,
                        use_transformer_engine: bool = False) -> GPTModel:
    """Builds the checkpoint's model as a ``GPTModel`` with an MTP block.

    ``parallel_state`` must already be initialized with this TP size (see
    :func:`init_parallel_cpu` for CPU). On a machine without CUDA the call must run
    inside ``cpu_compat.megatron_on_cpu()`` (``init_parallel_cpu`` holds it); weights
    are then initialized on CPU. Load real weights with ``convert.load_hf_state``.

    Args:
        hf_config: the checkpoint's config.json.
        tp_size: tensor-parallel size; must equal parallel_state's.
        params_dtype: dtype of the parameters.
        transformer_config: further ``TransformerConfig`` keyword arguments, passed
            through: training options such as ``recompute_granularity``,
            ``recompute_method``, ``recompute_num_layers``, ``sequence_parallel``. They may
            not set what the checkpoint's architecture or the other arguments set.
        use_transformer_engine: build with megatron-core's Transformer Engine spec instead
            of the local one. Needed for packed (THD) sequences: the local spec's attention
            refuses ``packed_seq_params``. Its parameter names (fused layer norms) are not
            the ones ``convert.py`` maps, so such a model cannot load or export checkpoints
            here.

    Raises:
        ValueError: unsupported architecture or config, a TP size that does not match
            parallel_state's, or a ``transformer_config`` key this function sets itself.
        RuntimeError: ``use_transformer_engine`` without Transformer Engine installed.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    spec = architecture_spec(hf_config)
    actual_tp = parallel_state.get_tensor_model_parallel_world_size()
    if actual_tp != tp_size:
        raise ValueError(f"tp_size: {tp_size}, but parallel_state was initialized with TP "
                         f"{actual_tp}")
    architecture = spec.config_kwargs(hf_config)
    extra = dict(transformer_config or {})
    taken = sorted(set(extra) & (set(architecture) | set(_SET_BY_BUILD)))
    if taken:
        raise ValueError(f"transformer_config: {taken} are set from the checkpoint's config "
                         "or this function's arguments")
    config = TransformerConfig(
        **architecture,
        **extra,
        tensor_model_parallel_size=tp_size,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
    )
    if use_transformer_engine:
        try:
            import transformer_engine  # noqa: F401
        except ImportError as exc:
            raise RuntimeError("use_transformer_engine=True needs Transformer Engine "
                               "(pip install transformer_engine[pytorch])") from exc
        layer_spec = get_gpt_layer_with_transformer_engine_spec()
    else:
        layer_spec = get_gpt_layer_local_spec(normalization=config.normalization)
    mtp_spec = get_gpt_mtp_block_spec(config, layer_spec,
                                      use_transformer_engine=use_transformer_engine)
    return GPTModel(config=config, transformer_layer_spec=layer_spec, mtp_block_spec=mtp_spec,
                    **spec.model_kwargs(hf_config))


@contextlib.contextmanager
def init_parallel_cpu(tp_size: int = 1, *, rank: int = 0, world_size: int | None = None,
                      init_method: str | None = None, seed: int = 0) -> Iterator[None]:
    """Inside the context, torch.distributed (gloo) and megatron's parallel_state are up.

    For the tests and the local demo: one process (``world_size`` 1, the default
    when ``tp_size`` is 1) or ``world_size`` processes that each enter the context
    with their ``rank`` and the same ``init_method``. Without CUDA the context also
    holds ``cpu_compat.megatron_on_cpu()``, so build and run the model inside it.
    On exit parallel_state and the process group are torn down.

    Args:
        tp_size: tensor-parallel size; the rest of the world is data parallel.
        rank: this process's rank.
        world_size: number of processes; defaults to ``tp_size``.
        init_method: rendezvous address (``tcp://host:port``); required when
            ``world_size`` > 1. A world of one needs no rendezvous (an in-memory store).
        seed: seeds torch (and, with CUDA, megatron's model-parallel RNG tracker).

    Raises:
        ValueError: ``world_size`` > 1 without ``init_method``, or a process group is
            already initialized in this process.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from trainer_client.megatron.cpu_compat import megatron_on_cpu

    world_size = tp_size if world_size is None else world_size
    if world_size > 1 and init_method is None:
        raise ValueError("init_method: required when world_size > 1")
    if dist.is_initialized():
        raise ValueError("a torch.distributed process group is already initialized")
    with megatron_on_cpu():
        if init_method is None:  # a world of one: no port to find, nothing to race for
            dist.init_process_group("gloo", store=dist.HashStore(), rank=rank,
                                    world_size=world_size)
        else:
            dist.init_process_group("gloo", init_method=init_method, rank=rank,
                                    world_size=world_size)
        try:
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size)
            torch.manual_seed(seed)
            if torch.cuda.is_available():
                tensor_parallel.model_parallel_cuda_manual_seed(seed)
            yield
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
