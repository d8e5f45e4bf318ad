"""Generates the embedded default model: a random-weight MiMo checkpoint with one MTP layer.

Runs in whichever process first asks for a model directory (the service before it
starts vLLM, a test, or the CLI); vLLM then reads the directory like any Hugging
Face checkpoint. Nothing is downloaded: the tokenizer ships in this package and
the weights come from a seeded CPU generator, so the same recipe always yields
bit-identical files, cached under a directory named by the recipe's hash.

The weights are random but shaped so speculative decoding has something to
measure. Embeddings dominate the residual stream (every block weight is small),
so the main model is roughly a bigram map `token -> lm_head(norm(embed(token)))`.
The MTP layer's `input_proj` is `[0 | I]` plus noise, so the drafter computes
roughly the same map on the token it is given, through the shared `lm_head`: it
agrees with the main model often, not always (greedy acceptance ~0.5-0.7).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from rollout_service.embedded.build_tokenizer import EOS_TOKEN, TOKENIZER_PATH, VOCAB_SIZE

RECIPE_VERSION = 2
"""Bump when the generator's output changes for the same inputs; it renames the cache dir.
2: the tokenizer config has a chat template."""
EOS_TOKEN_ID = 0
"""`<|endoftext|>` is the first token the BPE trainer adds."""
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
"""A trivial chat template (``role: content`` lines, then ``assistant:``), so that
``/v1/chat/completions`` serves the embedded model; it knows no conversation format."""
CACHE_ENV_VAR = "MTP_ROLLOUT_CACHE"
"""Root of the cache; the model directories live under `<root>/models/`."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSize:
    """Architecture of a generated checkpoint (Qwen2 body plus MiMo MTP layers)."""

    hidden_size: int
    """Width of the residual stream."""
    num_hidden_layers: int
    """Decoder layers of the main model (the MTP layers come on top)."""
    num_attention_heads: int
    """Query heads per attention layer."""
    num_key_value_heads: int
    """Key/value heads (grouped-query attention)."""
    head_dim: int
    """Per-head width; vLLM's Qwen2 derives it as hidden_size / num_attention_heads.
    64, because vLLM's CPU attention rejects small head sizes such as 16."""
    intermediate_size: int
    """Width of the SwiGLU MLP."""
    num_nextn_predict_layers: int = 1
    """MTP layers; vLLM reuses the single layer when asked for more draft tokens."""
    vocab_size: int = VOCAB_SIZE
    """Rows of the embedding and of lm_head; equals the shipped tokenizer's size."""
    max_position_embeddings: int = 2048
    """Longest sequence (prompt plus completion) the config allows."""

    def __post_init__(self) -> None:
        if self.head_dim * self.num_attention_heads != self.hidden_size:
            raise ValueError("head_dim * num_attention_heads must equal hidden_size")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightInit:
    """How the random weights are drawn; part of the recipe hash."""

    seed: int = 0
    """Base seed; each tensor gets its own generator seeded from (seed, name)."""
    embed_std: float = 1.0
    """Token embeddings carry the signal, so they are large."""
    block_gain: float = 0.3
    """Block matrices have std block_gain / sqrt(fan_in): blocks nudge, not rewrite."""
    bias_std: float = 0.02
    """Std of the q/k/v biases."""
    logit_std: float = 4.0
    """Std of the logits: peaked enough that sampling at temperature 1 is not uniform."""
    self_logit_penalty: float = 12.0
    """Logit taken off `token -> same token`, so greedy decoding avoids 1-token loops."""
    draft_noise: float = 0.25
    """Relative noise in the MTP input_proj; larger means lower acceptance."""


TINY = ModelSize(
    hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, intermediate_size=512,
)
SMALL = ModelSize(
    hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
    head_dim=64, intermediate_size=2816,
)
ONE_B = ModelSize(
    hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4,
    head_dim=128, intermediate_size=5632,
)
"""1.14B parameters (2.28 GB in bf16): the GPU benchmarks' mid-size shape."""
SEVEN_B = ModelSize(
    hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, intermediate_size=12288,
)
"""A 7B MiMo shape (MiMo-7B's hidden size and depth): the GPU benchmarks' large shape."""
MODEL_SIZES: dict[str, ModelSize] = {"tiny": TINY, "small": SMALL, "1b": ONE_B, "7b": SEVEN_B}


def model_size(name: str) -> ModelSize:
    """Looks up a preset by name.

    Raises:
        ValueError: for a name that is not in `MODEL_SIZES`.
    """
    if name not in MODEL_SIZES:
        raise ValueError(f"unknown model size {name!r}; choose from {sorted(MODEL_SIZES)}")
    return MODEL_SIZES[name]


def hf_config(size: ModelSize) -> dict[str, object]:
    """Returns config.json: a Qwen2 config that vLLM routes to MiMoForCausalLM."""
    return {
        "architectures": ["MiMoForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": size.vocab_size,
        "hidden_size": size.hidden_size,
        "intermediate_size": size.intermediate_size,
        "num_hidden_layers": size.num_hidden_layers,
        "num_attention_heads": size.num_attention_heads,
        "num_key_value_heads": size.num_key_value_heads,
        "head_dim": size.head_dim,
        "num_nextn_predict_layers": size.num_nextn_predict_layers,
        "hidden_act": "silu",
        "max_position_embeddings": size.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": size.num_hidden_layers,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": EOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "torch_dtype": "bfloat16",
    }


def _decoder_layer_shapes(prefix: str, size: ModelSize) -> dict[str, tuple[int, ...]]:
    """Returns the HF names and shapes of one Qwen2 decoder layer under `prefix`."""
    hidden, kv = size.hidden_size, size.num_key_value_heads * size.head_dim
    q = size.num_attention_heads * size.head_dim
    return {
        f"{prefix}self_attn.q_proj.weight": (q, hidden),
        f"{prefix}self_attn.q_proj.bias": (q,),
        f"{prefix}self_attn.k_proj.weight": (kv, hidden),
        f"{prefix}self_attn.k_proj.bias": (kv,),
        f"{prefix}self_attn.v_proj.weight": (kv, hidden),
        f"{prefix}self_attn.v_proj.bias": (kv,),
        f"{prefix}self_attn.o_proj.weight": (hidden, q),
        f"{prefix}mlp.gate_proj.weight": (size.intermediate_size, hidden),
        f"{prefix}mlp.up_proj.weight": (size.intermediate_size, hidden),
        f"{prefix}mlp.down_proj.weight": (hidden, size.intermediate_size),
        f"{prefix}input_layernorm.weight": (hidden,),
        f"{prefix}post_attention_layernorm.weight": (hidden,),
    }


def checkpoint_shapes(size: ModelSize) -> dict[str, tuple[int, ...]]:
    """Returns every tensor name in model.safetensors with its shape, without allocating.

    MTP layers are stored 0-indexed as `model.mtp_layers.{i}.`, with the decoder
    layer's names directly under that prefix: the layout vLLM's MiMoMTP remaps.
    """
    hidden, vocab = size.hidden_size, size.vocab_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    for i in range(size.num_hidden_layers):
        shapes.update(_decoder_layer_shapes(f"model.layers.{i}.", size))
    for i in range(size.num_nextn_predict_layers):
        prefix = f"model.mtp_layers.{i}."
        shapes.update(_decoder_layer_shapes(prefix, size))
        for norm in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
            shapes[f"{prefix}{norm}.weight"] = (hidden,)
        shapes[f"{prefix}input_proj.weight"] = (hidden, 2 * hidden)
    return shapes


def count_parameters(size: ModelSize) -> int:
    """Returns the number of parameters in the checkpoint (MTP layers included)."""
    return sum(torch.Size(shape).numel() for shape in checkpoint_shapes(size).values())


def _randn(name: str, shape: tuple[int, ...], init: WeightInit) -> torch.Tensor:
    """Draws N(0, 1) from a generator seeded by (seed, name): independent of tensor order."""
    digest = hashlib.sha256(f"{init.seed}:{name}".encode()).digest()
    generator = torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8]) >> 1)
    return torch.randn(shape, generator=generator, dtype=torch.float32)


def _init_tensor(
    name: str, shape: tuple[int, ...], init: WeightInit, embed: torch.Tensor
) -> torch.Tensor:
    """Returns one float32 tensor following the recipe in the module docstring."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return _randn(name, shape, init) * init.bias_std
    if name == "model.embed_tokens.weight":
        return embed
    fan_in = shape[1]
    if name == "lm_head.weight":
        # The final norm rescales a hidden state to norm ~sqrt(fan_in), and the residual
        # stream is mostly the embedding: this gives logits of std logit_std, and
        # `embed[t] . norm(embed[t]) ~ fan_in * embed_std` turns into -self_logit_penalty.
        head = _randn(name, shape, init) * (init.logit_std / fan_in**0.5)
        head -= embed * (init.self_logit_penalty / (fan_in * init.embed_std))
        head[EOS_TOKEN_ID] = 0.0  # logit 0 is far below the top: the model never stops.
        return head
    if name.endswith("input_proj.weight"):
        # input_proj(cat([hidden_normed, embed_normed])): keep the embedding half.
        noise = _randn(name, shape, init) * (init.draft_noise / fan_in**0.5)
        noise[:, shape[0]:] += torch.eye(shape[0])
        return noise
    return _randn(name, shape, init) * (init.block_gain / fan_in**0.5)


def generate_weights(size: ModelSize, init: WeightInit = WeightInit()) -> dict[str, torch.Tensor]:
    """Returns the full checkpoint as bf16 tensors, keyed by HF name."""
    shapes = checkpoint_shapes(size)
    embed_name = "model.embed_tokens.weight"
    embed = _randn(embed_name, shapes[embed_name], init) * init.embed_std
    return {
        name: _init_tensor(name, shape, init, embed).to(torch.bfloat16).contiguous()
        for name, shape in shapes.items()
    }


def recipe_hash(size: ModelSize, init: WeightInit = WeightInit()) -> str:
    """Returns a short hash of everything that determines the generated files."""
    recipe = {
        "version": RECIPE_VERSION,
        "size": asdict(size),
        "init": asdict(init),
        "tokenizer": hashlib.sha256(TOKENIZER_PATH.read_bytes()).hexdigest(),
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def _write_json(path: Path, payload: dict[str, object]) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_model(size: ModelSize, out_dir: Path, init: WeightInit = WeightInit()) -> int:
    """Writes a complete HF model directory into `out_dir` (created if missing).

    Returns:
        The number of parameters written.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = generate_weights(size, init)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out_dir / "config.json", hf_config(size))
    shutil.copyfile(TOKENIZER_PATH, out_dir / "tokenizer.json")
    _write_json(out_dir / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "model_max_length": size.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    })
    _write_json(out_dir / "generation_config.json", {
        "bos_token_id": EOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID, "pad_token_id": EOS_TOKEN_ID,
    })
    return sum(tensor.numel() for tensor in weights.values())


def default_cache_root() -> Path:
    """Returns `$MTP_ROLLOUT_CACHE`, or `~/.cache/mtp-rollout` when it is unset."""
    return Path(os.environ.get(CACHE_ENV_VAR) or Path.home() / ".cache" / "mtp-rollout")


def ensure_model(size: str = "tiny", cache_dir: Path | None = None,
                 init: WeightInit = WeightInit()) -> Path:
    """Returns the directory of the `size` model, generating it on first use.

    The directory is `<cache_dir>/models/mimo-<size>-<recipe hash>` (the hash covers
    `init`, so a drafter of another `draft_noise` is another directory). It is built
    in a temporary sibling and renamed into place, so a reader never sees a
    half-written model; when two processes race, the loser discards its copy.

    Args:
        size: a key of `MODEL_SIZES`.
        cache_dir: cache root; defaults to `default_cache_root()`.
        init: the weights' recipe (seed, drafter noise); the embedded default otherwise.

    Raises:
        ValueError: for an unknown size.
    """
    model = model_size(size)
    models_dir = (cache_dir or default_cache_root()) / "models"
    final_dir = models_dir / f"mimo-{size}-{recipe_hash(model, init)}"
    if final_dir.is_dir():
        return final_dir
    models_dir.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}-", dir=models_dir))
    try:
        write_model(model, tmp_dir, init)
        os.rename(tmp_dir, final_dir)
    except OSError:
        if not final_dir.is_dir():
            raise
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return final_dir


def main() -> None:
    """CLI: writes a model of the given size into --out and prints path and size."""
    parser = argparse.ArgumentParser(description="Generate a random-weight MiMo checkpoint.")
    parser.add_argument("--size", choices=sorted(MODEL_SIZES), default="tiny")
    parser.add_argument("--out", type=Path, help="output directory (default: the cache)")
    args = parser.parse_args()
    if args.out is None:
        path = ensure_model(args.size)
        num_params = count_parameters(model_size(args.size))
    else:
        path, num_params = args.out, write_model(model_size(args.size), args.out)
    print(path)
    print(f"{num_params} parameters ({num_params / 1e6:.1f}M)")


if __name__ == "__main__":
    main()
