"""The ``sglang`` test target: which integration tests apply there (its services launch
SGLang with ``bench.sglang_server.EAGER_SERVER_ARGS``).

Read by ``conftest.py`` in the pytest process, at collection. The same integration tests
run with ``ROLLOUT_TEST_TARGET=sglang`` on the GPU machine (the sglang bundle of
``tools/gpu/bundle``; ``tools/gpu/batch.sh sglang-tests``), against an SGLang 0.5.23 server
the session's service launches. A test runs there unless this table names it, with the
reason: it reads vLLM's own metrics or settings, or asserts what SGLang does differently
(each difference is what SGLang's source says; ``test_sglang_live.py`` tests SGLang's side
of it on the live server). Files that are not listed did not run against SGLang.
"""

from __future__ import annotations

_DIR = "tests/integration/rollout_service/"
RUN_ON_SGLANG = (f"{_DIR}test_api.py", f"{_DIR}test_weights.py", f"{_DIR}test_weights_refused.py",
                 f"{_DIR}test_openai.py",
                 f"{_DIR}test_no_speculation.py", f"{_DIR}test_engine_start.py",
                 f"{_DIR}test_sglang_live.py", f"{_DIR}test_sglang_cuda_ipc_live.py",
                 f"{_DIR}test_sglang_nccl_live.py",
                 f"{_DIR}test_sglang_service.py", f"{_DIR}test_dialect_weights.py")
"""The integration test files that apply to an SGLang service (less :data:`NOT_ON_SGLANG`).
The others test vLLM itself (its patches, its engine core's K schedule, its CUDA IPC and
NCCL transports), Ray Serve's vLLM replicas, the docs' vLLM samples, the trainer's parity
with vLLM, or the dialects' generation routes (not run on SGLang yet)."""

_SEEDS = ("seeded sampling: SGLang honours sampling_seed only on a server started with "
          "--enable-deterministic-inference (sglang/srt/sampling/sampling_batch_info.py), "
          "so two runs of one seeded request differ")
_VLLM_GAUGES = ("waits on vLLM's own counters (vllm:generation_tokens_total, "
                "vllm:num_requests_*), which an SGLang service does not export")
NOT_ON_SGLANG = {
    f"{_DIR}test_api.py::test_generate_with_mtp":
        "SGLang counts a verify step's whole accepted run, also tokens cut at max_tokens, so "
        "accepted + verify steps is 31 to 31 + k for 32 tokens (vLLM: 31 or 32); "
        "test_sglang_live.py::test_a_greedy_request_counts_as_sglang_reports",
    f"{_DIR}test_api.py::test_per_request_stats_match_engine_counters":
        "vLLM's own spec-decode counters; test_sglang_live.py::"
        "test_verify_steps_and_tokens_match_sglangs_own_counters",
    f"{_DIR}test_api.py::test_health_reports_model_and_engine":
        "expects engine 'vllm', method 'mtp' and vLLM's measured verify cost; "
        "test_sglang_live.py::test_health_names_sglang_and_its_drafter",
    f"{_DIR}test_weights.py::test_main_push_changes_outputs_and_versions_not_drafter":
        "SGLang's MTP drafter shares the main model's lm_head and embeddings "
        "(eagle_worker_v2.py, set_embed_and_head), so a main push of lm_head.weight moves "
        "the drafter's checksum too; test_sglang_live.py::"
        "test_main_push_changes_outputs_and_a_shared_head_moves_the_drafter",
    f"{_DIR}test_weights.py::test_draft_push_moves_acceptance_not_outputs":
        "compares greedy outputs across two drafters: in bf16 a verify step's shape follows "
        "the drafts and near-ties flip (1 % of the tiny model's greedy steps have a top-2 "
        "logit gap under 0.013; bf16 and float32 logits differ by up to 0.09), and it reads "
        "engine=\"vllm\" series; test_sglang_live.py::test_draft_push_moves_acceptance",
    f"{_DIR}test_weights.py::test_generation_during_push_sees_only_complete_versions":
        f"{_VLLM_GAUGES}: the push would come after the requests ended; "
        "test_sglang_live.py::test_a_push_during_generation_shows_in_the_spans",
    f"{_DIR}test_weights.py::test_keep_mode_freezes_requests_and_spans_show_the_switch":
        f"{_VLLM_GAUGES}; test_sglang_live.py::test_a_push_during_generation_shows_in_the_spans",
    f"{_DIR}test_openai.py::test_streamed_completion_is_the_whole_one_and_counted_once":
        f"{_SEEDS}; test_sglang_live.py::test_greedy_streams_and_chat_are_the_whole_answers",
    f"{_DIR}test_openai.py::test_streamed_chat_is_the_whole_chat_and_counted_once":
        f"{_SEEDS}; test_sglang_live.py::test_greedy_streams_and_chat_are_the_whole_answers",
    f"{_DIR}test_openai.py::test_a_client_gone_mid_stream_leaves_nothing_running":
        f"{_VLLM_GAUGES}; test_sglang_live.py::test_a_client_gone_mid_stream_aborts_in_sglang",
    f"{_DIR}test_dialect_weights.py::test_a_skyrl_sync_loads_main_then_drafter":
        "SkyRL's trainer is vLLM's NCCLTrainerWeightTransferEngine and HTTP client, and the "
        "sglang bundle has no vLLM; the vLLM dialect's routes on an SGLang service are "
        "the same layer over the same pushes (test_a_second_trainer_is_refused_until_the_"
        "first_lets_go calls them there)",
    f"{_DIR}test_openai.py::test_seeded_choices_survive_a_chunked_prefill":
        f"{_SEEDS}; and it tests a vLLM CPU fix",
}
"""Tests of :data:`RUN_ON_SGLANG` files that do not apply, with the reason."""


def sglang_skip_reason(nodeid: str) -> str | None:
    """Why the test ``nodeid`` does not run on the sglang target; None when it runs
    (a unit test, or a test this module lets through)."""
    if not nodeid.startswith("tests/integration/"):
        return None
    path, _, name = nodeid.partition("::")
    if path not in RUN_ON_SGLANG:
        return ("not run against SGLang: a vLLM, Ray Serve, trainer, docs or dialect test "
                "(tests/integration/sglang_target.py)")
    return NOT_ON_SGLANG.get(f"{path}::{name.partition('[')[0]}")
