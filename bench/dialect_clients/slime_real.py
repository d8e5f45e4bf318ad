"""slime's own code against the service (``--mode real``): the calls and checks of
:mod:`.slime`, made by slime's functions and classes as published.

``sglang_rollout.generate`` and ``sglang_streaming_rollout.generate_streaming`` fill a
``Sample`` (the service plays the router: ``--sglang-router-ip`` / ``--sglang-router-port``),
``GenerateState`` builds the sampling parameters from slime's arguments (its tokenizer
needs ``--tokenizer``); ``server_control.abort_servers_until_idle`` aborts;
``SGLangEngine`` (pointed at the service, no process of its own) checks health, pauses,
continues, flushes the cache and reads the weight version;
``external.discover_external_engines`` reads the service as an external engine. The top-p
request is posted once through slime's ``http_utils.post`` (``generate()`` retries a failure
60 times, a second apart) and its answer applied by ``Sample.append_response_tokens``, as
``generate()`` does.

Upstream: THUDM/slime at 624b824, the files :mod:`.slime` cites, and
``slime/utils/http_utils.py`` (``init_http_client``, ``post``, ``get``).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from .common import (
    PROMPT_IDS,
    SHORT_TOKENS,
    Row,
    Target,
    check_partial,
    expect,
    traced,
    traced_thread,
)
from .slime import (
    GEN,
    SERVER_INFO,
    TOP_P_LABEL,
    check_engine,
    check_meta,
    check_top_p_replay,
    check_weight_version,
)


def import_slime() -> None:
    """ImportError unless slime and the SGLang package it imports are here."""
    from slime.backends.sglang_utils import external, server_control  # noqa: F401
    from slime.backends.sglang_utils.sglang_engine import SGLangEngine  # noqa: F401
    from slime.rollout import sglang_rollout, sglang_streaming_rollout  # noqa: F401
    from slime.utils import http_utils  # noqa: F401
    from slime.utils.types import Sample  # noqa: F401


async def run(t: Target, row: Row) -> None:
    from slime.backends.sglang_utils import external, server_control
    from slime.backends.sglang_utils.sglang_engine import SGLangEngine
    from slime.rollout import sglang_rollout, sglang_streaming_rollout
    from slime.utils import http_utils
    from slime.utils.types import Sample

    host, port = t.host_port

    def make_args(top_p: float = 1.0) -> argparse.Namespace:
        # the fields of slime's arguments that generate(), GenerateState and
        # init_http_client read; the service plays the router (--sglang-router-ip/port)
        return argparse.Namespace(
            hf_checkpoint=t.tokenizer, rollout_temperature=1.0, rollout_top_p=top_p,
            rollout_top_k=-1, rollout_max_response_len=SHORT_TOKENS, rollout_stop=None,
            rollout_stop_token_ids=None, rollout_skip_special_tokens=False,
            sglang_server_concurrency=8, rollout_num_engines=1, sglang_dp_size=1,
            sglang_router_ip=host, sglang_router_port=port, ci_test=False,
            use_rollout_routing_replay=False, use_distributed_post=False,
            n_samples_per_prompt=1, sglang_speculative_algorithm="EAGLE",
            partial_rollout=False, router_policy=None)

    args = make_args()
    http_utils.init_http_client(args)
    sglang_rollout.GenerateState.clear_instances()
    state = sglang_rollout.GenerateState(args)
    engine = SGLangEngine(args, rank=0)
    engine.server_host, engine.server_port, engine.node_rank = host, port, 0
    weight_versions: list[str] = []

    def check_sample(call: str, sample: Any, wanted: int | None) -> None:
        expect(sample.status.name in ("TRUNCATED", "COMPLETED"), call, f"status {sample.status}")
        expect(sample.response_length > 0 and len(sample.rollout_log_probs or [])
               == sample.response_length, call,
               f"{sample.response_length} tokens, {len(sample.rollout_log_probs or [])} logprobs")
        if wanted is not None:
            expect(sample.response_length == wanted, call,
                   f"{sample.response_length} tokens, wanted {wanted}")
        expect(bool(sample.weight_versions), call, "no meta_info.weight_version")
        spec = sample.spec_info
        expect(spec.spec_verify_ct > 0 and 0 <= spec.spec_accept_token_num
               <= spec.spec_draft_token_num, call, f"spec counts {vars(spec)}")

    async def health() -> None:
        await traced_thread(row, "GET /health_generate", lambda: engine.health_generate(30.0))

    async def generate() -> None:
        sample = Sample(prompt="", tokens=list(PROMPT_IDS), index=0)
        sample = await traced(row, GEN, sglang_rollout.generate(
            args, sample, state.sampling_params.copy()))
        check_sample(GEN, sample, SHORT_TOKENS)
        weight_versions.extend(sample.weight_versions)

    async def generate_top_p() -> None:
        top_p_args = make_args(top_p=0.9)
        sglang_rollout.GenerateState.clear_instances()
        params = sglang_rollout.GenerateState(top_p_args).sampling_params
        sglang_rollout.GenerateState.clear_instances()
        sglang_rollout.GenerateState(args)
        answer = await traced(row, TOP_P_LABEL, http_utils.post(f"{t.url}/generate", {
            "sampling_params": params, "return_logprob": True, "input_ids": PROMPT_IDS},
            max_retries=1))
        check_meta(TOP_P_LABEL, answer, SHORT_TOKENS)
        sample = Sample(prompt="", tokens=list(PROMPT_IDS), index=3)
        entries = answer["meta_info"]["output_token_logprobs"]
        sample.append_response_tokens(top_p_args, tokens=[e[1] for e in entries],
                                      log_probs=[e[0] for e in entries], trainable=True,
                                      meta_info=answer["meta_info"], text=answer["text"])
        check_sample(TOP_P_LABEL, sample, SHORT_TOKENS)
        check_top_p_replay(TOP_P_LABEL, sample.rollout_top_p_token_ids,
                           sample.rollout_top_p_token_offsets, sample.response_length)

    async def stream() -> None:
        label = "POST /generate (stream)"
        sample = Sample(prompt="", tokens=list(PROMPT_IDS), index=1)
        sample = await traced(row, label, sglang_streaming_rollout.generate_streaming(
            args, sample, state.sampling_params.copy()))
        check_sample(label, sample, SHORT_TOKENS)

    async def abort() -> None:
        long = t.long_tokens
        sample = Sample(prompt="", tokens=list(PROMPT_IDS), index=2)
        params = dict(state.sampling_params, max_new_tokens=long, ignore_eos=True)
        task = asyncio.ensure_future(sglang_rollout.generate(args, sample, params))
        await t.in_flight(task)
        # sglang_rollout.py::abort lists the router's workers; here the service is the one
        row.call("POST /abort_request")
        row.call("GET /v1/loads?include=core")
        await server_control.abort_servers_until_idle([t.url])
        sample = await task
        label = f"{GEN} under POST /abort_request"
        expect(sample.status.name == "ABORTED", label, f"status {sample.status}")
        check_partial(label, sample.tokens[len(PROMPT_IDS):], sample.rollout_log_probs,
                      "abort", long)
        running = server_control.num_requests_from_load(
            await http_utils.get(f"{t.url}/v1/loads?include=core"))
        expect(running == 0, "GET /v1/loads?include=core", f"{running} requests after abort")

    async def engine_control() -> None:
        await traced_thread(row, "POST /pause_generation", engine.pause_generation)
        await traced_thread(row, "POST /continue_generation", engine.continue_generation)
        await traced_thread(row, "GET /flush_cache", engine.flush_cache)

    async def get_weight_version() -> None:
        version = await traced_thread(row, "GET /get_weight_version",
                                        engine.get_weight_version)
        check_weight_version(version, weight_versions)

    async def server_info() -> None:
        infos = await traced_thread(row, SERVER_INFO,
                                      lambda: external.discover_external_engines([t.url], 30))
        expect(len(infos) == 1 and infos[0].num_gpus >= 1, SERVER_INFO, f"engines {infos}")
        check_engine(infos[0].worker_type, infos[0].parallel_config)

    await row.step("health_generate", health)
    await row.step("generate", generate)
    await row.step("generate top-p", generate_top_p)
    await row.step("stream", stream)
    await row.step("abort", abort)
    await row.step("engine control", engine_control)
    await row.step("get_weight_version", get_weight_version)
    await row.step("server_info", server_info)
