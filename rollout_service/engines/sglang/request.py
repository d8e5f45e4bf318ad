"""One sequence's request to SGLang's ``/generate``: :class:`SamplingOptions` in SGLang's
names (``sglang/srt/sampling/sampling_params.py``, ``GenerateReqInput`` in
``sglang/srt/managers/io_struct.py``).

Runs in the rollout service process, once per request the SGLang engine sends.
"""

from __future__ import annotations

from typing import Any

from rollout_service.engines.sequences import SamplingOptions


def generate_body(sampling: SamplingOptions, request_id: str) -> dict[str, Any]:
    """The ``/generate`` body of one sequence, but its prompt (``input_ids`` or ``text``)."""
    body = {"rid": request_id, "sampling_params": sampling_params(sampling),
            "return_logprob": sampling.logprobs is not None
            or sampling.prompt_logprobs is not None}
    num_top = max(sampling.logprobs or 0, sampling.prompt_logprobs or 0)
    if num_top:
        body["top_logprobs_num"] = num_top
    if sampling.prompt_logprobs is not None:
        body["logprob_start_len"] = 0  # from the prompt's first token
    return body


_DEFAULTS: dict[str, Any] = {
    "min_new_tokens": 0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
    "frequency_penalty": 0.0, "skip_special_tokens": True,
    "spaces_between_special_tokens": True, "no_stop_trim": False}
"""SGLang's defaults of the fields sent only when a request changes them (the body stays
what every SGLang release since 0.4 accepts)."""


def sampling_params(sampling: SamplingOptions) -> dict[str, Any]:
    """SGLang's ``sampling_params`` (``sglang/srt/sampling/sampling_params.py``)."""
    params: dict[str, Any] = {
        "max_new_tokens": sampling.max_tokens, "temperature": sampling.temperature,
        "top_p": sampling.top_p, "top_k": sampling.top_k or -1,  # SGLang: -1 keeps all
        "ignore_eos": sampling.ignore_eos}
    optional = {
        "min_new_tokens": sampling.min_tokens, "min_p": sampling.min_p,
        "repetition_penalty": sampling.repetition_penalty,
        "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        "skip_special_tokens": sampling.skip_special_tokens,
        "spaces_between_special_tokens": sampling.spaces_between_special_tokens,
        "no_stop_trim": sampling.include_stop_str_in_output}
    params |= {name: value for name, value in optional.items() if value != _DEFAULTS[name]}
    if sampling.stop:
        params["stop"] = list(sampling.stop)
    if sampling.stop_token_ids:
        params["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.seed is not None:
        params["sampling_seed"] = sampling.seed
    return params
