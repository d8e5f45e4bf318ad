"""slime's rollout against the service's SGLang dialect: what it reads, and its payloads.

One row: ``GET /health_generate``; ``POST /generate`` (token ids in, ``text`` and
``meta_info`` out: the logprobs, finish reason, weight version, speculative counts, token
counts); the same with ``--rollout-top-p 0.9``, which sends ``custom_params:
{"return_top_p_token_ids": true}`` and needs each answer's top-p replay
(``meta_info.top_p_token_ids`` / ``top_p_token_offsets``: the nucleus kept at each
generated token), which ``RolloutManager._convert_samples_to_train_data`` asserts on every
sample; the streamed ``/generate``; ``abort_all`` during a ``--long-tokens`` request, then
``/v1/loads`` until idle (the aborted answer: its tokens so far, finish reason ``abort``);
``/pause_generation``, ``/continue_generation``, ``/flush_cache``;
``GET /get_weight_version``, which must say what ``/generate``'s
``meta_info.weight_version`` says (``actor_group.py`` compares the two with ``--ci-test``);
``GET /server_info`` (or ``/get_server_info``) read as an external engine
(``--rollout-external-engine-addrs``): worker type and parallel config.

This module holds the checks and the ``data`` calls; :mod:`.slime_real` makes the same
calls with slime's own code.

Upstream (THUDM/slime at 624b824): ``slime/rollout/sglang_rollout.py``
(``GenerateState.__init__``, ``generate``), ``slime/rollout/sglang_streaming_rollout.py``
(``generate_streaming``), ``slime/utils/types.py`` (``Sample.append_response_tokens``,
``_apply_meta_info``, ``_extract_rollout_top_p_token_data``), ``slime/utils/misc.py``
(``decode_int32_meta_array``), ``slime/ray/rollout.py``
(``RolloutManager._convert_samples_to_train_data``), ``slime/ray/actor_group.py``
(``_reload_rollout_weights_from_disk``),
``slime/backends/sglang_utils/server_control.py`` (``abort_servers_until_idle``,
``num_requests_from_load``), ``slime/backends/sglang_utils/sglang_engine.py``
(``SGLangEngine.health_generate``, ``pause_generation``, ``continue_generation``,
``flush_cache``, ``get_weight_version``), ``slime/backends/sglang_utils/external.py``
(``get_server_info``, ``discover_external_engines``, ``ExternalEngineInfo``); the top-p
replay comes from slime's SGLang patch ``docker/patch/latest/sglang-top_p.patch``.
"""

from __future__ import annotations

import asyncio
import base64
import json
from array import array
from typing import Any

from .common import (
    PROMPT_IDS,
    SHORT_TOKENS,
    CallFailed,
    Row,
    Target,
    check_partial,
    error_message,
    expect,
    load_real,
)

SLIME = "slime"
SLIME_AT = "THUDM/slime@624b824"
"""The commit read (slime publishes no package)."""
SOURCES = [
    f"{SLIME_AT} slime/rollout/sglang_rollout.py (GenerateState.__init__, generate)",
    f"{SLIME_AT} slime/rollout/sglang_streaming_rollout.py (generate_streaming)",
    f"{SLIME_AT} slime/utils/types.py (Sample.append_response_tokens, _apply_meta_info)",
    f"{SLIME_AT} slime/ray/rollout.py (RolloutManager._convert_samples_to_train_data: "
    "the top-p replay)",
    f"{SLIME_AT} slime/backends/sglang_utils/server_control.py "
    "(abort_servers_until_idle, num_requests_from_load)",
    f"{SLIME_AT} slime/backends/sglang_utils/sglang_engine.py (SGLangEngine."
    "health_generate, pause_generation, continue_generation, flush_cache, "
    "get_weight_version)",
    f"{SLIME_AT} slime/backends/sglang_utils/external.py (get_server_info, "
    "discover_external_engines)"]
GEN = "POST /generate"
TOP_P_LABEL = "POST /generate (--rollout-top-p 0.9)"
SERVER_INFO = "GET /server_info (or /get_server_info)"
TOP_P_IDS = ("top_p_token_ids", "top_p_kept_token_ids")
TOP_P_OFFSETS = ("top_p_token_offsets", "top_p_kept_token_offsets")
"""types.py's names of the top-p replay in ``meta_info``, either spelling."""


def slime_sampling(max_new_tokens: int, top_p: float = 1.0) -> dict[str, Any]:
    """GenerateState.__init__ with the defaults of slime/utils/arguments.py
    (--rollout-temperature 1, --rollout-top-p 1, --rollout-top-k -1, no stop,
    --rollout-skip-special-tokens off)."""
    params: dict[str, Any] = {
        "temperature": 1.0, "top_p": top_p, "top_k": -1, "max_new_tokens": max_new_tokens,
        "stop": None, "stop_token_ids": None, "skip_special_tokens": False,
        "no_stop_trim": True, "spaces_between_special_tokens": False}
    if top_p != 1.0:
        params["custom_params"] = {"return_top_p_token_ids": True}
    return params


def check_meta(call: str, answer: dict[str, Any], wanted: int | None = None) -> None:
    """What slime reads from one answer: ``text``, ``meta_info.output_token_logprobs`` and,
    on the final one (Sample._apply_meta_info), ``finish_reason.type``, ``weight_version``,
    ``spec_accept_token_num``, ``spec_draft_token_num``, ``spec_verify_ct``,
    ``completion_tokens``, ``cached_tokens``, ``prompt_tokens``."""
    meta = answer["meta_info"]
    entries = meta.get("output_token_logprobs") or []
    expect(isinstance(answer.get("text"), str) and bool(entries), call, "no text or logprobs")
    expect(meta["finish_reason"]["type"] in ("stop", "length"), call,
           f"finish_reason {meta['finish_reason']}")
    expect(meta.get("completion_tokens") == len(entries), call,
           f"completion_tokens {meta.get('completion_tokens')} for {len(entries)} logprobs")
    if wanted is not None:
        expect(len(entries) == wanted, call, f"{len(entries)} tokens, wanted {wanted}")
    missing = [k for k in ("weight_version", "spec_accept_token_num", "spec_draft_token_num",
                           "spec_verify_ct", "cached_tokens", "prompt_tokens")
               if meta.get(k) is None]
    expect(not missing, call, f"meta_info without {missing}")
    expect(0 <= meta["spec_accept_token_num"] <= meta["spec_draft_token_num"], call,
           f"accepted {meta['spec_accept_token_num']} of {meta['spec_draft_token_num']}")


def int32_meta(meta: dict[str, Any], keys: tuple[str, ...]) -> list[int] | None:
    """misc.py::decode_int32_meta_array: the first key present, a list or base64 int32."""
    value = next((meta[k] for k in keys if k in meta), None)
    if isinstance(value, str):
        return list(array("i", base64.b64decode(value)))
    return None if value is None else [int(v) for v in value]


def check_top_p_replay(call: str, ids: Any, offsets: Any, response_length: int) -> None:
    """_convert_samples_to_train_data's asserts with --rollout-top-p below 1: the sample has
    its kept token ids and offsets, ``response_length + 1`` offsets ending at their count."""
    expect(ids is not None and offsets is not None, call,
           "meta_info without the top-p replay (top_p_token_ids, top_p_token_offsets), which "
           "slime's RolloutManager asserts on every sample with --rollout-top-p below 1 "
           "(stock SGLang ignores custom_params.return_top_p_token_ids too; slime's own "
           "SGLang patch, docker/patch/latest/sglang-top_p.patch, returns it)")
    expect(len(offsets) == response_length + 1 and int(offsets[-1]) == len(ids), call,
           f"{len(offsets)} top-p offsets ending at {int(offsets[-1]) if len(offsets) else None}"
           f" for {response_length} tokens and {len(ids)} kept ids")


def check_weight_version(version: Any, generated: list[str]) -> None:
    """``GET /get_weight_version`` against ``/generate``'s ``meta_info.weight_version``."""
    label = "GET /get_weight_version"
    expect(bool(generated), label, "no /generate answer's meta_info.weight_version to "
           "compare with")
    expect(str(version) == str(generated[0]), label,
           f"{version!r}, while /generate's meta_info.weight_version is {generated[0]!r}")


def check_engine(worker_type: str, parallel: dict[str, int]) -> None:
    """An external engine as discover_external_engines reads it: a regular worker (not
    prefill, decode or encoder), its parallel config (``ExternalEngineInfo.parallel_config``)."""
    expect(worker_type == "regular", SERVER_INFO, f"worker type {worker_type!r}")
    expect(all(isinstance(v, int) and v >= 1 for v in parallel.values()), SERVER_INFO,
           f"parallel config {parallel}")


def engine_from_info(info: dict[str, Any]) -> tuple[str, dict[str, int]]:
    """external.py's reading of server info: _infer_worker_type and parallel_config."""
    if info.get("encoder_only"):
        worker = "encoder"
    else:
        mode = info.get("disaggregation_mode")
        worker = mode if mode in ("prefill", "decode") else "regular"
    pp = int(info.get("pp_size") or info.get("pipeline_parallel_size") or 1)
    tp = int(info.get("tp_size") or info.get("tensor_parallel_size") or 1)
    gpus = int(info.get("num_gpus") or info.get("num_gpus_per_engine") or tp * pp)
    return worker, {
        "tp_size": int(info.get("tp_size") or info.get("tensor_parallel_size") or gpus // pp),
        "pp_size": pp,
        "ep_size": int(info.get("ep_size") or info.get("expert_parallel_size") or 1),
        "moe_dp_size": int(info.get("moe_dp_size") or info.get("moe_data_parallel_size") or 1)}


async def run(t: Target, mode: str) -> list[Row]:
    row = Row(f"{SLIME} rollout, abort, engine control", "SGLang")

    def load() -> Any:
        from . import slime_real
        slime_real.import_slime()
        return slime_real

    real = load_real(mode, [row], load)
    if real is None and mode == "real":
        return [row]
    if real is not None and t.tokenizer is None:
        if mode == "real":
            row.failures.append("real client unavailable: GenerateState loads the "
                                "checkpoint's tokenizer: give --tokenizer")
            return [row]
        real = None
    if real is not None:
        row.code = "real"
        await real.run(t, row)
    else:
        await run_data(t, row)
    return [row]


async def run_data(t: Target, row: Row) -> None:
    weight_versions: list[str] = []

    def body(max_new_tokens: int, top_p: float = 1.0, **extra: Any) -> dict[str, Any]:
        # sglang_rollout.py::generate: sampling_params, return_logprob, input_ids
        return {"sampling_params": {**slime_sampling(max_new_tokens, top_p), **extra},
                "return_logprob": True, "input_ids": PROMPT_IDS}

    async def health() -> None:
        # SGLangEngine.health_generate; _wait_server_healthy adds the server's api_key
        await t.send(row, "GET", "/health_generate",
                     headers={"Content-Type": "application/json; charset=utf-8"})

    async def generate() -> None:
        answer = (await t.send(row, "POST", "/generate", json_body=body(SHORT_TOKENS))).json()
        check_meta(GEN, answer, SHORT_TOKENS)
        weight_versions.append(answer["meta_info"]["weight_version"])

    async def generate_top_p() -> None:
        answer = (await t.send(row, "POST", "/generate", label=TOP_P_LABEL,
                               json_body=body(SHORT_TOKENS, top_p=0.9))).json()
        check_meta(TOP_P_LABEL, answer, SHORT_TOKENS)
        meta = answer["meta_info"]
        check_top_p_replay(TOP_P_LABEL, int32_meta(meta, TOP_P_IDS),
                           int32_meta(meta, TOP_P_OFFSETS), len(meta["output_token_logprobs"]))

    async def stream() -> None:
        # sglang_streaming_rollout.py::generate_streaming: "data:" lines, cumulative
        label = "POST /generate (stream)"
        row.call(label)
        last: dict[str, Any] = {}
        async with t.http.stream("POST", t.url + "/generate", headers=t.auth, json={
                **body(SHORT_TOKENS), "stream": True}) as resp:
            expect(resp.status_code == 200, label, f"{resp.status_code}")
            async for line in resp.aiter_lines():
                if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                    last = json.loads(line[5:])
        check_meta(label, last, SHORT_TOKENS)

    async def abort() -> None:
        long = t.long_tokens
        task = asyncio.ensure_future(t.http.post(t.url + "/generate", headers=t.auth,
                                                 json=body(long, ignore_eos=True)))
        await t.in_flight(task)
        # server_control.py::abort_server_until_idle: abort all, then poll the loads
        await t.send(row, "POST", "/abort_request", json_body={"abort_all": True})
        resp = await task
        expect(resp.status_code == 200, GEN, f"{resp.status_code} {error_message(resp)}")
        loads = (await t.send(row, "GET", "/v1/loads", params={"include": "core"})).json()
        running = sum(int(x.get("num_running_reqs", 0)) + int(x.get("num_waiting_reqs", 0))
                      for x in loads.get("loads", []))
        expect(running == 0, "GET /v1/loads?include=core", f"{running} requests after abort")
        meta = resp.json()["meta_info"]
        entries = meta.get("output_token_logprobs") or []
        check_partial(f"{GEN} under POST /abort_request", [e[1] for e in entries],
                      [e[0] for e in entries], meta["finish_reason"]["type"], long)

    async def engine_control() -> None:
        # SGLangEngine.pause_generation / continue_generation (json {}), flush_cache (GET)
        await t.send(row, "POST", "/pause_generation", json_body={})
        await t.send(row, "POST", "/continue_generation", json_body={})
        await t.send(row, "GET", "/flush_cache")

    async def get_weight_version() -> None:
        # SGLangEngine.get_weight_version reads weight_version
        resp = await t.send(row, "GET", "/get_weight_version")
        check_weight_version(resp.json()["weight_version"], weight_versions)

    async def server_info() -> None:
        # external.py::get_server_info: /server_info, else /get_server_info
        row.call(SERVER_INFO)
        errors = []
        for path in ("/server_info", "/get_server_info"):
            resp = await t.http.get(t.url + path, headers=t.auth)
            if resp.status_code < 400:
                check_engine(*engine_from_info(resp.json()))
                return
            errors.append(f"{path}: {resp.status_code} {error_message(resp)}")
        raise CallFailed(SERVER_INFO, "; ".join(errors))

    await row.step("health_generate", health)
    await row.step("generate", generate)
    await row.step("generate top-p", generate_top_p)
    await row.step("stream", stream)
    await row.step("abort", abort)
    await row.step("engine control", engine_control)
    await row.step("get_weight_version", get_weight_version)
    await row.step("server_info", server_info)
