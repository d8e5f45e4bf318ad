"""What the FAKE SGLang server (``fake_sglang``) speaks per SGLang version: 0.5.10,
0.5.11, 0.5.12 and 0.5.23 (``PROFILES``).

Each ``Profile`` holds what differs between them: the ``meta_info`` key names of the
speculative counts, whether responses carry weight-version spans, whether the server has
weight-update sessions, and its request classes with their field names as in SGLang's
``io_struct``. ``request_models`` turns those into the pydantic models (named like
SGLang's request classes) that parse the fake's request bodies.
``test_sglang_conformance``'s tests compare them with SGLang's own ``io_struct`` sources,
and check ``/generate`` traffic with 0.5.23's generated JSON contract
(``sglang/api/v1/api_types.py``), when ``SGLANG_SOURCES`` names unpacked SGLang wheels.
Plain data, imported by the fake in the test process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, create_model

Selector = Literal["target", "draft", "all"]


@dataclass(frozen=True, kw_only=True)
class Profile:
    """What differs between the SGLang versions the fake speaks."""

    version: str
    spec_keys: tuple[tuple[str, str], ...]
    """(accepted, proposed) meta_info key pairs emitted, in emission order."""
    histogram_key: str
    has_weight_version_spans: bool
    has_weight_update_session: bool
    models: dict[str, dict[str, Any]]
    """Request class name -> own field name -> (type, default), as in SGLang's io_struct."""


_BASE_REQ = {"rid": (str | None, None), "http_worker_ipc": (str | None, None)}
_GENERATE = {
    "text": (str | list[str] | None, None),
    "input_ids": (list[int] | list[list[int]] | None, None),
    "sampling_params": (dict[str, Any] | None, None), "return_logprob": (bool | None, None),
    "logprob_start_len": (int | None, None), "top_logprobs_num": (int | None, None),
    "return_text_in_logprobs": (bool, False), "stream": (bool, False),
}
_TENSOR_0510 = {
    "serialized_named_tensors": (list[str], ...), "load_format": (str | None, None),
    "flush_cache": (bool, True), "abort_all_requests": (bool, False),
    "weight_version": (str | None, None), "disable_draft_model": (bool | None, None),
}
_COMMON_MODELS = {
    "PauseGenerationReqInput": {"mode": (Literal["abort", "retract", "in_place"], "abort")},
}
_EMPTY_CACHE = {"torch_empty_cache": (bool, False)}
_OLD_KEYS = (("spec_accept_token_num", "spec_draft_token_num"),)
_MID_KEYS = (("spec_accepted_drafts", "spec_proposed_drafts"),)
_NEW_KEYS = (("spec_num_correct_drafts", "spec_num_proposed_drafts"),)


def _old_models(*, has_empty_cache: bool, continue_fields: dict[str, Any]) -> dict[str, Any]:
    extra = _EMPTY_CACHE if has_empty_cache else {}
    return {**_COMMON_MODELS, "GenerateReqInput": _GENERATE,
            "ContinueGenerationReqInput": continue_fields,
            "UpdateWeightsFromTensorReqInput": {**_TENSOR_0510, **extra},
            "CheckWeightsReqInput": {"action": (str, ...)}}


PROFILES: dict[str, Profile] = {
    "0.5.10": Profile(version="0.5.10", spec_keys=_OLD_KEYS, histogram_key="spec_accept_histogram",
                      has_weight_version_spans=False, has_weight_update_session=False,
                      models=_old_models(has_empty_cache=False, continue_fields={})),
    "0.5.11": Profile(version="0.5.11", spec_keys=_MID_KEYS, histogram_key="spec_accept_histogram",
                      has_weight_version_spans=False, has_weight_update_session=False,
                      models=_old_models(has_empty_cache=True, continue_fields={})),
    # 0.5.12 renamed the keys and kept the 0.5.11 names as aliases for one release.
    "0.5.12": Profile(version="0.5.12", spec_keys=_NEW_KEYS + _MID_KEYS,
                      histogram_key="spec_correct_drafts_histogram",
                      has_weight_version_spans=False, has_weight_update_session=False,
                      models=_old_models(has_empty_cache=True,
                                         continue_fields={"torch_empty_cache": (bool, True)})),
    "0.5.23": Profile(
        version="0.5.23", spec_keys=_NEW_KEYS, histogram_key="spec_correct_drafts_histogram",
        has_weight_version_spans=True, has_weight_update_session=True,
        models={
            **_COMMON_MODELS,
            # No longer a BaseReq: it declares rid and http_worker_ipc itself.
            "GenerateReqInput": {**_BASE_REQ, "rid": (str | list[str] | None, None),
                                 **_GENERATE, "return_prompt_token_ids": (bool, False)},
            "ContinueGenerationReqInput": {"torch_empty_cache": (bool, True)},
            "UpdateWeightsFromTensorReqInput": {
                **{k: v for k, v in _TENSOR_0510.items() if k != "disable_draft_model"},
                "selector": (Selector, "all"), **_EMPTY_CACHE},
            "BeginWeightUpdateReqInput": {"selector": (Selector, "all")},
            "EndWeightUpdateReqInput": {},
            "CheckWeightsReqInput": {
                "action": (str, "checksum"), "allow_quant_error": (bool, False),
                "skip_tensor_list": (list[str] | None, None), "selector": (Selector, "all")},
        }),
}


def request_models(profile: Profile) -> dict[str, type[BaseModel]]:
    """Pydantic request models under SGLang's class names (BaseReq fields included)."""
    config = ConfigDict(extra="ignore")  # SGLang ignores unknown fields
    return {name: create_model(name, __config__=config, **{**_BASE_REQ, **fields})
            for name, fields in profile.models.items()}
