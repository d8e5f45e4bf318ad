"""Tests for rollout_service.engines.speculative against the installed vLLM (CPU build)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from rollout_service.engines.speculative import (
    FALLBACK_VLLM_METHODS,
    MTPSettings,
    accepted_vllm_methods,
    build_sglang_server_args,
    build_vllm_speculative_config,
    load_checkpoint_config,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
FIELD = "engine_kwargs.speculative_config"
MTP = MTPSettings()
MTP_CHECKPOINT = {"architectures": ["MiMoForCausalLM"], "num_nextn_predict_layers": 1}
# The first call imports vLLM (seconds), so hypothesis must not time single examples.
PROPERTY = settings(deadline=None)


def vllm(user=None, mtp=MTP, checkpoint=None):
    kwargs = {} if user is None else {"speculative_config": user}
    return build_vllm_speculative_config(mtp, kwargs, checkpoint)


# ---- vLLM: merge rules -------------------------------------------------------------------


def test_service_defaults_without_user_config():
    assert vllm() == {"method": "mtp", "num_speculative_tokens": 1}
    assert vllm(mtp=MTPSettings(method="mimo_mtp", num_speculative_tokens=3)) == {
        "method": "mimo_mtp",
        "num_speculative_tokens": 3,
    }


def test_user_keys_win_and_extra_keys_pass_through():
    user = {"num_speculative_tokens": 2, "method": "deepseek_mtp", "enforce_eager": True}
    assert vllm(user) == user


def test_user_none_means_service_default():
    user = {"method": None, "num_speculative_tokens": None, "draft_tensor_parallel_size": None}
    assert vllm(user) == {"method": "mtp", "num_speculative_tokens": 1}
    assert vllm(None) == vllm({})


def test_json_string_equals_mapping():
    user = {"num_speculative_tokens": 3, "rejection_sample_method": "standard", "x": None}
    expected = {"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "standard"}
    assert vllm(json.dumps(user)) == vllm(user) == expected


def test_disabled_without_user_config_is_none():
    disabled = MTPSettings(enabled=False)
    assert vllm(mtp=disabled) is None
    assert vllm({"method": None}, mtp=disabled) is None
    assert vllm("{}", mtp=disabled) is None


def test_disabled_passes_user_config_without_service_defaults():
    disabled = MTPSettings(enabled=False)
    assert vllm({"method": "ngram", "prompt_lookup_max": 4}, mtp=disabled) == {
        "method": "ngram",
        "prompt_lookup_max": 4,
    }
    with pytest.raises(ValueError, match=f"{FIELD}.method"):
        vllm({"method": "bogus"}, mtp=disabled)


def test_input_mapping_is_not_mutated():
    user = {"method": None, "num_speculative_tokens": 2}
    vllm(user)
    assert user == {"method": None, "num_speculative_tokens": 2}


# ---- vLLM: rejections --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("user", "field", "hint"),
    [
        ([("method", "mtp")], FIELD, "mapping or a JSON object string"),
        (3, FIELD, "mapping or a JSON object string"),
        ('{"method": "mtp",', FIELD, "not valid JSON"),
        ("[1, 2]", FIELD, "must hold an object"),
        ('"mtp"', FIELD, "must hold an object"),
        ("null", FIELD, "must hold an object"),
        ({"num_speculative_tokens": 0}, f"{FIELD}.num_speculative_tokens", "integer >= 1"),
        ({"num_speculative_tokens": -2}, f"{FIELD}.num_speculative_tokens", "integer >= 1"),
        ({"num_speculative_tokens": 1.5}, f"{FIELD}.num_speculative_tokens", "integer >= 1"),
        ({"num_speculative_tokens": 2.0}, f"{FIELD}.num_speculative_tokens", "integer >= 1"),
        ({"num_speculative_tokens": "2"}, f"{FIELD}.num_speculative_tokens", "integer >= 1"),
        ({"num_speculative_tokens": True}, f"{FIELD}.num_speculative_tokens", "integer >= 1"),
        ('{"num_speculative_tokens": true}', f"{FIELD}.num_speculative_tokens", "integer"),
        ({"method": "bogus"}, f"{FIELD}.method", "'mimo_mtp'"),
        ({"method": 1}, f"{FIELD}.method", "accepted"),
        ({"method": ["mtp"]}, f"{FIELD}.method", "accepted"),
        ({"method": "MTP"}, f"{FIELD}.method", "accepted"),
    ],
)
def test_rejects_bad_user_config(user, field, hint):
    with pytest.raises(ValueError) as excinfo:
        vllm(user)
    message = str(excinfo.value)
    assert message.startswith(field), message
    assert hint in message


def test_rejects_unknown_service_method_naming_the_setting():
    with pytest.raises(ValueError, match=r"^mtp\.method: unknown method 'bogus'"):
        vllm(mtp=MTPSettings(method="bogus"))


def test_accepted_methods_come_from_installed_vllm():
    methods = accepted_vllm_methods()
    assert {"mtp", "mimo_mtp", "deepseek_mtp", "eagle", "ngram"} <= methods
    assert "bogus" not in methods
    # Nested Literals (MTPModelTypes inside EagleModelTypes) are flattened: strings only.
    assert all(isinstance(method, str) for method in methods)


def test_fallback_matches_installed_vllm():
    assert accepted_vllm_methods() == FALLBACK_VLLM_METHODS, (
        "update FALLBACK_VLLM_METHODS to the installed vLLM's SpeculativeMethod"
    )


def test_fallback_used_when_vllm_is_not_importable(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm.config.speculative", None)  # import -> ImportError
    assert accepted_vllm_methods.__wrapped__() == FALLBACK_VLLM_METHODS


# ---- vLLM: checkpoint MTP layers ---------------------------------------------------------


@pytest.mark.parametrize(
    "checkpoint",
    [
        {"architectures": ["Qwen2ForCausalLM"]},
        {"num_nextn_predict_layers": 0},
        {"mtp_num_hidden_layers": 0, "num_mtp_modules": None},
        {"text_config": {"num_hidden_layers": 4}},
    ],
)
@pytest.mark.parametrize(("user", "field"), [(None, "mtp.method"), ({"method": "mimo_mtp"}, FIELD)])
def test_rejects_mtp_on_checkpoint_without_mtp_layers(checkpoint, user, field):
    with pytest.raises(ValueError, match="needs MTP layers") as excinfo:
        vllm(user, checkpoint=checkpoint)
    assert str(excinfo.value).startswith(field)
    assert "num_nextn_predict_layers" in str(excinfo.value)


@pytest.mark.parametrize(
    "checkpoint",
    [
        MTP_CHECKPOINT,
        {"num_mtp_modules": 2},
        {"mtp_num_hidden_layers": 1},
        {"text_config": {"mtp_num_hidden_layers": 1}},
    ],
)
def test_accepts_mtp_on_checkpoint_with_mtp_layers(checkpoint):
    assert vllm({"num_speculative_tokens": 2}, checkpoint=checkpoint)["method"] == "mtp"


def test_checkpoint_check_skipped_without_config_or_for_other_methods():
    assert vllm(checkpoint=None)["method"] == "mtp"
    assert vllm({"method": "ngram"}, checkpoint={"num_nextn_predict_layers": 0})["method"] == (
        "ngram"
    )


def test_load_checkpoint_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MTP_CHECKPOINT))
    assert load_checkpoint_config(tmp_path) == MTP_CHECKPOINT
    assert load_checkpoint_config(str(tmp_path)) == MTP_CHECKPOINT


def test_load_checkpoint_config_rejects_missing_or_broken(tmp_path):
    with pytest.raises(ValueError, match="config.json not found") as excinfo:
        load_checkpoint_config(tmp_path)
    assert str(tmp_path) in str(excinfo.value)
    (tmp_path / "config.json").write_text("{broken")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_checkpoint_config(tmp_path)
    (tmp_path / "config.json").write_text("[]")
    with pytest.raises(ValueError, match="JSON object"):
        load_checkpoint_config(tmp_path)


# ---- MTPSettings -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_speculative_tokens": 0},
        {"num_speculative_tokens": True},
        {"sglang_algorithm": "MEDUSA"},
        {"sglang_eagle_topk": 0},
        {"sglang_num_draft_tokens": 1},
        {"unknown": 1},
    ],
)
def test_settings_reject_bad_values(kwargs):
    with pytest.raises(ValidationError):
        MTPSettings(**kwargs)


def test_settings_are_frozen_and_documented():
    with pytest.raises(ValidationError):
        MTP.num_speculative_tokens = 2
    assert all(info.description for info in MTPSettings.model_fields.values())


# ---- SGLang ------------------------------------------------------------------------------


def test_sglang_defaults_and_disabled():
    assert build_sglang_server_args(MTP, {}) == {
        "speculative_algorithm": "EAGLE",
        "speculative_num_steps": 1,
        "speculative_eagle_topk": 1,
        "speculative_num_draft_tokens": 2,
    }
    disabled = MTPSettings(enabled=False)
    assert build_sglang_server_args(disabled, {"speculative_num_steps": 3}) == {}


def test_sglang_user_keys_win_none_ignored():
    kwargs = {
        "speculative_algorithm": "NEXTN",
        "speculative_num_steps": 3,
        "speculative_eagle_topk": None,
        "speculative_num_draft_tokens": None,
        "mem_fraction_static": 0.8,
    }
    assert build_sglang_server_args(MTP, kwargs) == {
        "speculative_algorithm": "NEXTN",
        "speculative_num_steps": 3,
        "speculative_eagle_topk": 1,
        "speculative_num_draft_tokens": 4,
    }


def test_sglang_tree_defaults_and_bounds():
    tree = MTPSettings(num_speculative_tokens=5, sglang_eagle_topk=8)
    assert build_sglang_server_args(tree, {})["speculative_num_draft_tokens"] == 41
    # SGLang's documented tuning example: 5 steps, topk 8, 64 draft tokens.
    kwargs = {"speculative_num_draft_tokens": 64}
    assert build_sglang_server_args(tree, kwargs)["speculative_num_draft_tokens"] == 64
    small = MTPSettings(num_speculative_tokens=2, sglang_eagle_topk=2)
    args = build_sglang_server_args(small, {"speculative_num_draft_tokens": 7})
    assert args["speculative_num_draft_tokens"] == 7
    with pytest.raises(ValueError, match=r"^engine_kwargs\.speculative_num_draft_tokens=8: .* 7"):
        build_sglang_server_args(small, {"speculative_num_draft_tokens": 8})


@pytest.mark.parametrize(
    ("mtp", "kwargs", "field", "hint"),
    [
        (MTP, {"speculative_algorithm": "eagle"}, "engine_kwargs.speculative_algorithm", "EAGLE3"),
        (MTP, {"speculative_algorithm": "NGRAM"}, "engine_kwargs.speculative_algorithm", "NEXTN"),
        (MTP, {"speculative_num_steps": 0}, "engine_kwargs.speculative_num_steps", ">= 1"),
        (MTP, {"speculative_num_steps": True}, "engine_kwargs.speculative_num_steps", ">= 1"),
        (MTP, {"speculative_eagle_topk": 1.0}, "engine_kwargs.speculative_eagle_topk", ">= 1"),
        (MTP, {"speculative_num_draft_tokens": 1}, "engine_kwargs.speculative_num_draft_tokens",
         ">= 2"),
        (MTP, {"speculative_num_draft_tokens": 4}, "engine_kwargs.speculative_num_draft_tokens",
         "speculative_num_steps + 1 = 2"),
        (MTPSettings(sglang_num_draft_tokens=3), {}, "mtp.sglang_num_draft_tokens",
         "forces speculative_num_draft_tokens"),
    ],
)  # fmt: skip
def test_sglang_rejections_name_the_field(mtp, kwargs, field, hint):
    with pytest.raises(ValueError) as excinfo:
        build_sglang_server_args(mtp, kwargs)
    assert str(excinfo.value).startswith(field), str(excinfo.value)
    assert hint in str(excinfo.value)


@PROPERTY
@given(num_steps=st.integers(1, 64), from_user=st.booleans())
def test_sglang_topk_one_forces_steps_plus_one(num_steps, from_user):
    if from_user:
        args = build_sglang_server_args(MTP, {"speculative_num_steps": num_steps})
    else:
        args = build_sglang_server_args(MTPSettings(num_speculative_tokens=num_steps), {})
    assert args["speculative_eagle_topk"] == 1
    assert args["speculative_num_draft_tokens"] == num_steps + 1


@PROPERTY
@given(num_steps=st.integers(1, 16), topk=st.integers(2, 16), data=st.data())
def test_sglang_tree_draft_tokens_within_bounds(num_steps, topk, data):
    max_draft = topk + (num_steps - 1) * topk**2 + 1
    num_draft = data.draw(st.integers(2, max_draft))
    kwargs = {"speculative_num_steps": num_steps, "speculative_eagle_topk": topk}
    default = build_sglang_server_args(MTP, kwargs)["speculative_num_draft_tokens"]
    assert 2 <= default <= max_draft
    kwargs["speculative_num_draft_tokens"] = num_draft
    assert build_sglang_server_args(MTP, kwargs)["speculative_num_draft_tokens"] == num_draft


# ---- vLLM: properties --------------------------------------------------------------------

JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
MTP_METHODS = sorted(m for m in FALLBACK_VLLM_METHODS if m == "mtp" or m.endswith("_mtp"))
USER_CONFIGS = st.builds(
    lambda extra, method, num_tokens: {
        **extra,
        **({} if method is ... else {"method": method}),
        **({} if num_tokens is ... else {"num_speculative_tokens": num_tokens}),
    },
    st.dictionaries(
        st.text(max_size=12).filter(lambda k: k not in ("method", "num_speculative_tokens")),
        JSON_SCALARS,
        max_size=6,
    ),
    st.just(...) | st.none() | st.sampled_from(sorted(FALLBACK_VLLM_METHODS)),
    st.just(...) | st.none() | st.integers(1, 16),
)
SETTINGS = st.builds(
    MTPSettings, method=st.sampled_from(MTP_METHODS), num_speculative_tokens=st.integers(1, 8)
)


@PROPERTY
@given(user=USER_CONFIGS, mtp=SETTINGS)
def test_merge_properties(user, mtp):
    config = vllm(user, mtp=mtp)
    user_set = {k: v for k, v in user.items() if v is not None}
    for key, value in user_set.items():
        assert config[key] == value
    defaults = {"method": mtp.method, "num_speculative_tokens": mtp.num_speculative_tokens}
    for key, value in defaults.items():
        if key not in user_set:
            assert config[key] == value
    assert set(config) == set(user_set) | set(defaults)
    assert None not in config.values()


@PROPERTY
@given(user=USER_CONFIGS, mtp=SETTINGS, enabled=st.booleans())
def test_json_string_and_mapping_give_equal_results(user, mtp, enabled):
    mtp = mtp.model_copy(update={"enabled": enabled})
    assert vllm(json.dumps(user), mtp=mtp) == vllm(user, mtp=mtp)


@PROPERTY
@given(user=USER_CONFIGS, num_layers=st.integers(0, 3))
def test_mtp_layer_check_property(user, num_layers):
    checkpoint = {"num_nextn_predict_layers": num_layers}
    method = user.get("method") or MTP.method
    if num_layers == 0 and (method == "mtp" or method.endswith("_mtp")):
        with pytest.raises(ValueError, match="needs MTP layers"):
            vllm(user, checkpoint=checkpoint)
    else:
        assert vllm(user, checkpoint=checkpoint)["method"] == method


# ---- package contract --------------------------------------------------------------------


def test_import_does_not_load_vllm_or_torch():
    code = (
        "import rollout_service.engines.speculative, sys; "
        "assert 'vllm' not in sys.modules and 'torch' not in sys.modules, "
        "sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch'))"
    )
    python_path = [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(python_path)}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
