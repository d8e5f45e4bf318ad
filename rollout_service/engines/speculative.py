"""MTP speculative-decoding settings for the rollout engines.

The rollout service runs this once at startup, in its own process, before it builds an
engine: it turns the service's `MTPSettings` and the user's `engine_kwargs` into vLLM's
`speculative_config` or SGLang's `speculative_*` server arguments. Nothing here talks to
another process.

Merge rules:
- The service contributes defaults (vLLM: `method`, `num_speculative_tokens`; SGLang: the
  four `speculative_*` arguments); a key the user sets wins.
- A user value of None means "not set": it is dropped before merging, so the service
  default applies. The result never holds None. Only top-level keys are inspected.
- vLLM's `engine_kwargs["speculative_config"]` may be a mapping or a JSON object string;
  both give the same result.
- MTP disabled: vLLM gets the user's own `speculative_config` validated but without
  service defaults, or None when the user gave none (or only None values); SGLang gets
  {} and the user's own `speculative_*` keys reach SGLang untouched.

Why: verl's builder does the same merge but raises a TypeError on a wrong type, passes any
method or token count through to fail deep inside engine start-up (or to run silently
without a drafter on a checkpoint with no MTP layers), and has no test. Here each mistake
is a ValueError that names the field and the accepted values, raised before an engine
exists.

vLLM and torch are never imported at module import time (the package contract): vLLM is
imported, once, only to read the speculative methods it accepts.
"""

from __future__ import annotations

import functools
import json
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

SGLangAlgorithm = Literal["EAGLE", "EAGLE3", "NEXTN"]
SGLANG_ALGORITHMS: tuple[str, ...] = typing.get_args(SGLangAlgorithm)

# Used only when vLLM cannot be imported (e.g. an SGLang-only install). Copied from vLLM
# 0.32's `vllm.config.speculative.SpeculativeMethod`; a test keeps it equal to the installed one.
FALLBACK_VLLM_METHODS: frozenset[str] = frozenset({
    "ngram", "medusa", "mlp_speculator", "draft_model", "suffix", "custom_class", "eagle",
    "eagle3", "extract_hidden_states", "dflash", "ngram_gpu", "dspark", "mtp",
    "deepseek_mtp", "dots3_note_mtp", "mimo_mtp", "mimo_v2_mtp", "glm4_moe_mtp",
    "glm4_moe_lite_mtp", "glm_ocr_mtp", "ernie_mtp", "nemotron_h_mtp", "exaone_moe_mtp",
    "exaone4_5_mtp", "qwen3_next_mtp", "qwen4_exp_mtp", "qwen3_5_mtp", "longcat_flash_mtp",
    "bailing_hybrid_v3_mtp", "minimax_m3_mtp", "bailing_hybrid_mtp", "kimi_k3_mtp",
    "pangu_ultra_moe_mtp", "step3p5_mtp", "hy_v3_mtp", "hy_v4_mtp", "gemma4_mtp",
    "inkling_mtp", "glm5_next_mtp",
})  # fmt: skip

# config.json keys that count a checkpoint's MTP layers (DeepSeek/MiMo/GLM, others, Qwen3-Next).
MTP_LAYER_KEYS = ("num_nextn_predict_layers", "num_mtp_modules", "mtp_num_hidden_layers")

_VLLM_FIELD = "engine_kwargs.speculative_config"
# SGLang server argument -> the MTPSettings field that supplies its default.
_SGLANG_DEFAULT_FIELDS = {
    "speculative_algorithm": "sglang_algorithm",
    "speculative_num_steps": "num_speculative_tokens",
    "speculative_eagle_topk": "sglang_eagle_topk",
    "speculative_num_draft_tokens": "sglang_num_draft_tokens",
}


class MTPSettings(BaseModel):
    """The service's MTP speculative-decoding settings (embedded in the service config).

    `method` is checked against the installed vLLM by `build_vllm_speculative_config`, not
    here, so that parsing the service config never imports vLLM.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(True, description="Use the checkpoint's MTP layers as the drafter.")
    method: str = Field("mtp", description=(
        "vLLM speculative method: 'mtp' or a '*_mtp' name (the checkpoint's MTP layers, which "
        "weight pushes load); any other method vLLM knows runs, without drafter pushes."))
    num_speculative_tokens: int = Field(
        1, gt=0, description="Draft tokens per step (vLLM) and SGLang's speculative_num_steps."
    )
    sglang_algorithm: SGLangAlgorithm = Field(
        "EAGLE", description="SGLang speculative_algorithm; NEXTN is SGLang's alias of EAGLE."
    )
    sglang_eagle_topk: int = Field(1, ge=1, description="SGLang speculative_eagle_topk.")
    sglang_num_draft_tokens: int | None = Field(
        None, ge=2, description="SGLang speculative_num_draft_tokens; None: steps * topk + 1."
    )

    @field_validator(
        "num_speculative_tokens", "sglang_eagle_topk", "sglang_num_draft_tokens", mode="before"
    )
    @classmethod
    def _reject_bool(cls, value: object) -> object:
        # pydantic's lax mode turns True into 1; a bool here is a mistake, not a count.
        if isinstance(value, bool):
            raise ValueError("must be an integer, not a bool")
        return value


@functools.cache
def accepted_vllm_methods() -> frozenset[str]:
    """The speculative methods the installed vLLM accepts (FALLBACK_VLLM_METHODS without it)."""
    try:
        from vllm.config import speculative
    except ImportError:
        return FALLBACK_VLLM_METHODS
    return frozenset(_literal_values(speculative.SpeculativeMethod))


def _literal_values(tp: object) -> set[str]:
    values: set[str] = set()
    for arg in typing.get_args(tp):
        values |= _literal_values(arg) if typing.get_origin(arg) is Literal else {arg}
    return values


def load_checkpoint_config(model_path: str | Path) -> dict[str, Any]:
    """Read a local checkpoint's config.json.

    Args:
        model_path: a local checkpoint directory.

    Raises:
        ValueError: config.json is missing, is not valid JSON or is not a JSON object.
    """
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise ValueError(f"{path} not found: model_path must be a local checkpoint directory")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(config).__name__}")
    return config


def build_vllm_speculative_config(
    mtp: MTPSettings,
    engine_kwargs: Mapping[str, Any],
    checkpoint_config: Mapping[str, Any] | None = None,
) -> dict[str, Any] | None:
    """Merge the service's MTP settings with the user's vLLM `speculative_config`.

    Args:
        mtp: the service's MTP settings.
        engine_kwargs: the user's vLLM engine kwargs; only "speculative_config" is read.
        checkpoint_config: the checkpoint's parsed config.json; None skips the MTP-layer check.

    Returns:
        The `speculative_config` for vLLM, or None when MTP is disabled and the user gave none.

    Raises:
        ValueError: the user's config is not a mapping or a JSON object string, the method is
            unknown to the installed vLLM, the token count is not a positive integer, or an MTP
            method is asked for on a checkpoint without MTP layers.
    """
    raw = engine_kwargs.get("speculative_config")
    user = {} if raw is None else _parse_user_config(raw)
    if not mtp.enabled and not user:
        return None
    defaults = {"method": mtp.method, "num_speculative_tokens": mtp.num_speculative_tokens}
    config = {**(defaults if mtp.enabled else {}), **user}

    def field(key: str) -> str:
        return f"{_VLLM_FIELD}.{key}" if key in user else f"mtp.{key}"

    method = config.get("method")
    accepted = accepted_vllm_methods()
    if "method" in config and (not isinstance(method, str) or method not in accepted):
        raise ValueError(
            f"{field('method')}: unknown method {method!r}; accepted: {sorted(accepted)}"
        )
    if "num_speculative_tokens" in config:
        _check_count(config["num_speculative_tokens"], field("num_speculative_tokens"))
    has_no_mtp_layers = checkpoint_config is not None and _num_mtp_layers(checkpoint_config) == 0
    if is_mtp_method(method) and has_no_mtp_layers:
        raise ValueError(
            f"{field('method')}: {method!r} needs MTP layers, but the checkpoint config has none "
            f"(one of {list(MTP_LAYER_KEYS)} > 0); use a checkpoint with MTP layers or disable MTP"
        )
    return config


def is_mtp_method(method: object) -> bool:
    """Whether a vLLM speculative method drafts with the checkpoint's own MTP layers: 'mtp'
    or a model-specific '*_mtp' name (vLLM normalizes those to 'mtp')."""
    return isinstance(method, str) and (method == "mtp" or method.endswith("_mtp"))


def build_sglang_server_args(mtp: MTPSettings, engine_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """SGLang's speculative server arguments from the service's MTP settings.

    SGLang drafts a tree: topk candidates per step, `speculative_num_steps` deep, and
    verifies `speculative_num_draft_tokens` of its nodes (the root included). With topk 1 the
    tree is a chain and SGLang forces draft tokens to steps + 1; a different value is refused
    here rather than silently changed. With topk > 1 the default is steps * topk + 1 (topk
    full-length branches), and a value must lie in [2, topk + (steps - 1) * topk**2 + 1],
    the number of tree nodes SGLang ranks (its torch.topk fails beyond that).

    Args:
        mtp: the service's MTP settings.
        engine_kwargs: the user's SGLang engine kwargs; the four `speculative_*` keys built
            here win over the settings when not None.

    Returns:
        `speculative_algorithm`, `speculative_num_steps`, `speculative_eagle_topk` and
        `speculative_num_draft_tokens`; {} when MTP is disabled.

    Raises:
        ValueError: an unknown algorithm, a count that is not a positive integer, or a draft
            token count that breaks the rule above.
    """
    if not mtp.enabled:
        return {}
    values = {key: getattr(mtp, name) for key, name in _SGLANG_DEFAULT_FIELDS.items()}
    user = {key: engine_kwargs[key] for key in values if engine_kwargs.get(key) is not None}
    values.update(user)

    def field(key: str) -> str:
        return f"engine_kwargs.{key}" if key in user else f"mtp.{_SGLANG_DEFAULT_FIELDS[key]}"

    algorithm = values["speculative_algorithm"]
    if algorithm not in SGLANG_ALGORITHMS:
        raise ValueError(
            f"{field('speculative_algorithm')}: unknown algorithm {algorithm!r}; "
            f"accepted: {list(SGLANG_ALGORITHMS)}"
        )
    num_steps, topk = (
        _check_count(values[key], field(key))
        for key in ("speculative_num_steps", "speculative_eagle_topk")
    )
    num_draft = values["speculative_num_draft_tokens"]
    if num_draft is None:
        num_draft = num_steps * topk + 1  # steps + 1 for a chain (topk 1)
    _check_count(num_draft, field("speculative_num_draft_tokens"), minimum=2)
    if topk == 1 and num_draft != num_steps + 1:
        raise ValueError(
            f"{field('speculative_num_draft_tokens')}={num_draft}: with speculative_eagle_topk 1 "
            f"SGLang forces speculative_num_draft_tokens to speculative_num_steps + 1 = "
            f"{num_steps + 1}; set it to that, leave it unset, or raise the topk"
        )
    max_draft = topk + (num_steps - 1) * topk**2 + 1
    if num_draft > max_draft:
        raise ValueError(
            f"{field('speculative_num_draft_tokens')}={num_draft}: with {num_steps} steps and "
            f"topk {topk} SGLang's draft tree has room for at most topk + (steps - 1) * topk**2 "
            f"+ 1 = {max_draft} tokens"
        )
    return {**values, "speculative_num_draft_tokens": num_draft}


def _parse_user_config(raw: object) -> dict[str, Any]:
    """The user's speculative_config as a dict without None values."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{_VLLM_FIELD}: not valid JSON ({e}); expected a JSON object such as "
                '\'{"method": "mtp", "num_speculative_tokens": 1}\''
            ) from e
        if not isinstance(raw, dict):
            raise ValueError(
                f"{_VLLM_FIELD}: the JSON string must hold an object, got {type(raw).__name__}"
            )
    if not isinstance(raw, Mapping):
        raise ValueError(
            f"{_VLLM_FIELD}: expected a mapping or a JSON object string, got {type(raw).__name__}"
        )
    return {key: value for key, value in raw.items() if value is not None}


def _check_count(value: object, field: str, minimum: int = 1) -> int:
    # bool is an int subclass, but True is never a meant count.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{field} must be an integer >= {minimum}, got {value!r}")
    return value


def _num_mtp_layers(checkpoint_config: Mapping[str, Any]) -> int:
    # Multimodal checkpoints (e.g. Qwen3.5) keep the language model's keys under text_config.
    for config in (checkpoint_config, checkpoint_config.get("text_config") or {}):
        for key in MTP_LAYER_KEYS:
            value = config.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return 0
