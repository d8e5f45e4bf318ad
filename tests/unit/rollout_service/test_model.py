"""Tests for the embedded default model (corpus, tokenizer, random MiMo checkpoint).

Fast CPU tests: they read the generated files with safetensors and tokenizers and
never start a vLLM engine (the engine tests load the same directory for real).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file
from tokenizers import Tokenizer

from rollout_service.embedded import ModelSize, ensure_model, tiny_mimo
from rollout_service.embedded.build_tokenizer import CORPUS_PATH, TOKENIZER_PATH, VOCAB_SIZE
from rollout_service.embedded.corpus import arithmetic_prompts, corpus_text

# Written out by hand rather than taken from the generator: this is the layout
# vLLM's Qwen2 / MiMo / MiMoMTP loaders read.
DECODER_LAYER_SUFFIXES = (
    "self_attn.q_proj.weight", "self_attn.q_proj.bias",
    "self_attn.k_proj.weight", "self_attn.k_proj.bias",
    "self_attn.v_proj.weight", "self_attn.v_proj.bias",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "input_layernorm.weight", "post_attention_layernorm.weight",
)
MTP_ONLY_SUFFIXES = (
    "token_layernorm.weight", "hidden_layernorm.weight", "input_proj.weight",
    "final_layernorm.weight",
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_model("tiny", cache_dir=tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def tiny_config(tiny_dir: Path) -> dict:
    return json.loads((tiny_dir / "config.json").read_text())


def _tensor_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}


def _expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """HF Qwen2 + MiMo MTP shapes, derived from config.json alone."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    head_dim = hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    inter = config["intermediate_size"]
    layer = dict(zip(DECODER_LAYER_SUFFIXES, [
        (q, hidden), (q,), (kv, hidden), (kv,), (kv, hidden), (kv,), (hidden, q),
        (inter, hidden), (inter, hidden), (hidden, inter), (hidden,), (hidden,),
    ]))
    mtp_only = dict(zip(MTP_ONLY_SUFFIXES, [(hidden,), (hidden,), (hidden, 2 * hidden), (hidden,)]))
    shapes = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    for i in range(config["num_hidden_layers"]):
        shapes.update({f"model.layers.{i}.{s}": shape for s, shape in layer.items()})
    for i in range(config["num_nextn_predict_layers"]):
        shapes.update({f"model.mtp_layers.{i}.{s}": shape for s, shape in layer.items()})
        shapes.update({f"model.mtp_layers.{i}.{s}": shape for s, shape in mtp_only.items()})
    return shapes


def test_config_describes_a_mimo_checkpoint_with_one_mtp_layer(tiny_config: dict) -> None:
    assert tiny_config["architectures"] == ["MiMoForCausalLM"]
    assert tiny_config["model_type"] == "qwen2"
    assert tiny_config["num_nextn_predict_layers"] == 1
    assert tiny_config["torch_dtype"] == "bfloat16"
    assert tiny_config["tie_word_embeddings"] is False
    assert tiny_config["max_position_embeddings"] == 2048
    assert tiny_config["vocab_size"] == VOCAB_SIZE
    assert tiny_config["hidden_size"] // tiny_config["num_attention_heads"] == 64
    assert tiny_config["head_dim"] == 64


def test_checkpoint_names_and_shapes_match_config(tiny_dir: Path, tiny_config: dict) -> None:
    actual = _tensor_shapes(tiny_dir)
    expected = _expected_shapes(tiny_config)
    assert set(actual) == set(expected)
    assert actual == expected


def test_checkpoint_is_bfloat16(tiny_dir: Path) -> None:
    tensors = load_file(str(tiny_dir / "model.safetensors"))
    assert {tensor.dtype for tensor in tensors.values()} == {torch.bfloat16}


def test_small_shapes_match_config_and_parameter_count() -> None:
    size = tiny_mimo.SMALL
    shapes = tiny_mimo.checkpoint_shapes(size)
    assert shapes == _expected_shapes(tiny_mimo.hf_config(size))
    assert 90e6 <= tiny_mimo.count_parameters(size) <= 120e6


def test_generation_is_bit_identical(tiny_dir: Path, tmp_path: Path) -> None:
    other = ensure_model("tiny", cache_dir=tmp_path)
    assert other != tiny_dir
    names = sorted(os.listdir(tiny_dir))
    assert names == sorted(os.listdir(other))
    for name in names:
        assert (tiny_dir / name).read_bytes() == (other / name).read_bytes(), name


def test_ensure_model_keeps_each_drafter_noise_apart(tiny_dir: Path, tmp_path: Path) -> None:
    """Another ``draft_noise`` is another directory whose drafter differs and whose main
    model does not (the same trunk, a worse or better drafter)."""
    init = tiny_mimo.WeightInit(draft_noise=0.6)
    noisy = ensure_model("tiny", cache_dir=tmp_path, init=init)
    assert noisy.name == f"mimo-tiny-{tiny_mimo.recipe_hash(tiny_mimo.TINY, init)}"
    base, other = (load_file(str(d / "model.safetensors")) for d in (tiny_dir, noisy))
    drafter = [n for n in base if n.startswith("model.mtp_layers.")]
    assert drafter and any(not torch.equal(base[n], other[n]) for n in drafter)
    assert all(torch.equal(base[n], other[n]) for n in base if n not in drafter)


def test_ensure_model_reuses_the_cached_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    write_model = tiny_mimo.write_model
    monkeypatch.setattr(tiny_mimo, "write_model", lambda *a: calls.append(a) or write_model(*a))
    first = ensure_model("tiny", cache_dir=tmp_path)
    mtime_ns = (first / "model.safetensors").stat().st_mtime_ns
    second = ensure_model("tiny", cache_dir=tmp_path)
    assert first == second
    assert len(calls) == 1
    assert (second / "model.safetensors").stat().st_mtime_ns == mtime_ns
    assert first.name == f"mimo-tiny-{tiny_mimo.recipe_hash(tiny_mimo.TINY)}"
    assert [p.name for p in (tmp_path / "models").iterdir()] == [first.name]


def test_ensure_model_survives_losing_a_race(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process renames its copy into place while this one is writing."""
    write_model = tiny_mimo.write_model
    final_dir = tmp_path / "models" / f"mimo-tiny-{tiny_mimo.recipe_hash(tiny_mimo.TINY)}"

    def write_while_other_process_wins(size: ModelSize, out_dir: Path,
                                       init: tiny_mimo.WeightInit) -> int:
        write_model(size, final_dir, init)
        (final_dir / "winner").touch()
        return write_model(size, out_dir, init)

    monkeypatch.setattr(tiny_mimo, "write_model", write_while_other_process_wins)
    assert ensure_model("tiny", cache_dir=tmp_path) == final_dir
    assert (final_dir / "winner").exists()
    assert [p.name for p in (tmp_path / "models").iterdir()] == [final_dir.name]


def test_default_cache_root_follows_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(tiny_mimo.CACHE_ENV_VAR, str(tmp_path))
    assert tiny_mimo.default_cache_root() == tmp_path
    monkeypatch.delenv(tiny_mimo.CACHE_ENV_VAR)
    assert tiny_mimo.default_cache_root() == Path.home() / ".cache" / "mtp-rollout"


def test_unknown_size_and_inconsistent_size_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown model size"):
        ensure_model("huge", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="head_dim"):
        ModelSize(hidden_size=256, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, intermediate_size=512)


def test_drafter_approximates_the_main_models_bigram_map(tiny_dir: Path) -> None:
    """The design that gives MTP a useful acceptance rate, checked without vLLM.

    Ignoring the (small) transformer blocks, the main model maps token t to
    lm_head(norm(embed[t])) and the MTP layer maps (previous hidden, t) to
    lm_head(norm(input_proj([norm(hidden), norm(embed[t])]))). Their argmaxes
    should agree often but not always (vLLM measured ~0.6 greedy acceptance).
    """
    w = {k: v.float() for k, v in load_file(str(tiny_dir / "model.safetensors")).items()}
    embed, head = w["model.embed_tokens.weight"], w["lm_head.weight"]
    input_proj = w["model.mtp_layers.0.input_proj.weight"]

    def rms_norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    main_logits = rms_norm(embed) @ head.T
    previous = rms_norm(embed.roll(1, dims=0))
    draft_logits = rms_norm(torch.cat([previous, rms_norm(embed)], -1) @ input_proj.T) @ head.T
    agreement = (main_logits.argmax(-1) == draft_logits.argmax(-1)).float().mean().item()
    assert 0.4 <= agreement <= 0.9
    assert 3.0 <= main_logits.std().item() <= 5.0
    greedy_next = main_logits.argmax(-1)
    assert not (greedy_next == torch.arange(len(greedy_next))).any(), "1-token loop"
    assert not (greedy_next == tiny_mimo.EOS_TOKEN_ID).any(), "random model should not stop"


def test_model_dir_ships_tokenizer_files(tiny_dir: Path) -> None:
    assert (tiny_dir / "tokenizer.json").read_bytes() == TOKENIZER_PATH.read_bytes()
    tokenizer_config = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    for key in ("eos_token", "bos_token", "pad_token"):
        assert tokenizer_config[key] == "<|endoftext|>"
    generation_config = json.loads((tiny_dir / "generation_config.json").read_text())
    assert generation_config["eos_token_id"] == tiny_mimo.EOS_TOKEN_ID


def test_tokenizer_round_trips_the_corpus() -> None:
    tokenizer = Tokenizer.from_file(str(TOKENIZER_PATH))
    assert tokenizer.get_vocab_size() == VOCAB_SIZE
    assert tokenizer.token_to_id("<|endoftext|>") == tiny_mimo.EOS_TOKEN_ID
    lines = CORPUS_PATH.read_text(encoding="utf-8").splitlines()
    encodings = tokenizer.encode_batch(lines)
    assert tokenizer.decode_batch([e.ids for e in encodings]) == lines
    # Merges were learned: far fewer tokens than bytes.
    assert sum(len(e.ids) for e in encodings) < 0.5 * sum(len(line) for line in lines)


def test_shipped_corpus_matches_generator() -> None:
    text = CORPUS_PATH.read_text(encoding="utf-8")
    assert text == corpus_text()
    assert len(text.encode()) < 300_000


def test_arithmetic_prompts_are_correct_and_deterministic() -> None:
    pairs = arithmetic_prompts(50, seed=3)
    assert pairs == arithmetic_prompts(50, seed=3)
    assert pairs != arithmetic_prompts(50, seed=4)
    for prompt, answer in pairs:
        assert prompt.startswith("Q: ") and prompt.endswith(" = ? A:")
        expression = prompt.removeprefix("Q: ").removesuffix(" = ? A:")
        assert str(eval(expression)) == answer  # noqa: S307 - generated digits and + - *
    with pytest.raises(ValueError):
        arithmetic_prompts(-1)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 20), seed=st.integers(0, 2**32))
def test_arithmetic_prompts_prefix_stable(n: int, seed: int) -> None:
    """A longer list extends a shorter one, so n can grow without reshuffling rewards."""
    assert arithmetic_prompts(n, seed) == arithmetic_prompts(n + 5, seed)[:n]
