#!/usr/bin/env bash
# On the GPU machine, after `source tools/gpu/project_env.sh` (carry .gpuextra, and .whl
# for `trainer`): the GPU work of the open issues as named steps, each under
# with_stacks.sh (stacks when its log stops growing) and its own time limit, with any
# engine or service a previous step left behind killed first (the test steps watch their
# own logs). Logs under $OUT. One call of the device tool runs at most 600 s: give each
# call the steps that fit. Kills every python -m rollout_service/bench/pytest/vllm of
# the machine: for the GPU machine only.
#
#   bash tools/gpu/batch.sh tests sync          # ~9 min (one call each if it stalls)
#   bash tools/gpu/batch.sh serving             # ~6-8 min
#   bash tools/gpu/batch.sh serving-dialects    # ~8-9 min: + the OpenAI and SGLang dialects
#   bash tools/gpu/batch.sh spec-tests          # ~5-9 min (graphs captured per start)
#   bash tools/gpu/batch.sh spec                # ~5 min (spec-full: ~9 min)
#   bash tools/gpu/batch.sh spec-profile        # ~5 min: where K = 0 costs (py-spy)
#   bash tools/gpu/batch.sh spec-floor          # ~4 min: K = 0's kernels vs spec-off's (torch
#                                               #   profiler; BATCH 256, CAPTURE_TOKENS 2048)
#   bash tools/gpu/batch.sh spec-skip           # ~6 min: spec with drafter_at_k0: skip
#   bash tools/gpu/batch.sh spec-repro churn    # ~5 + 4 min: the illegal memory access
#   bash tools/gpu/batch.sh churn-modes         # ~10 min: the crash with PIECEWISE or FULL
#                                               #   decode graphs only, and vLLM alone
#   bash tools/gpu/batch.sh churn-pin churn-pin-static  # ~9 min: K = 1, 2 pinned, no change
#   bash tools/gpu/batch.sh churn-upstream      # ~5 min: vLLM alone, 33 then 32 requests
#   bash tools/gpu/batch.sh churn-align         # ~5 min: the churn with aligned sizes
#   bash tools/gpu/batch.sh churn-tests         # ~5 min: test_spec_churn.py, run and skip
#   bash tools/gpu/batch.sh spec-ab             # ~9 min: drafter_at_k0 run vs skip at K = 0
#   NOISE=0.6 bash tools/gpu/batch.sh spec-bench # ~9 min: the issue's benchmark, one drafter
#   bash tools/gpu/batch.sh load starts trainer # ~4 + 5 + 5 min
#   bash tools/gpu/batch.sh sync7b              # ~6-9 min: the 7B shape (15 GB per push)
#
# Ray Serve on the GPU (issue item 6), after `source tools/gpu/ray_env.sh` as well (Ray carried
# by tools/gpu/prepare_ray.sh; docs/ray-serve.md), one call each:
#   bash tools/gpu/batch.sh rayserve            # ~9 min: 2 replicas on one GPU vs the service
#   bash tools/gpu/batch.sh rayserve-load       # ~8-9 min: 100 pushes through the Ray ingress
#
# SGLang (issue 28), after `source tools/gpu/project_env_sglang.sh` instead (the sglang
# bundle in /tmp/site-sglang; carry .gpuextra), one call each:
#   bash tools/gpu/batch.sh sglang-smoke        # ~4-6 min: checkpoints, the JIT kernels,
#                                               #   SGLang alone, the service launching it
#   bash tools/gpu/batch.sh sglang-tests        # ~5-9 min: ROLLOUT_TEST_TARGET=sglang
#   bash tools/gpu/batch.sh sglang-ipc-tests    # ~2-4 min: cuda_ipc pushes into a live SGLang
#   bash tools/gpu/batch.sh sglang-dialect-tests  # ~2-4 min: slime's gloo sync into SGLang
#   bash tools/gpu/batch.sh sglang-nccl-tests   # ~2-4 min, two GPUs: nccl pushes into SGLang
#   bash tools/gpu/batch.sh sglang-serving      # ~6-9 min: service vs SGLang's own server
#   bash tools/gpu/batch.sh sglang-serving-128  # ~5-6 min: 128 in flight, 9 short rounds
#   bash tools/gpu/batch.sh sglang-serving-long # ~5-7 min: 128 in flight, 8 waves, py-spy
#   bash tools/gpu/batch.sh sglang-serving-mixed  # ~4-6 min: 128 in flight, lengths +-50%
#   bash tools/gpu/batch.sh sglang-sync         # ~4-6 min: 1b shm and cuda_ipc pushes vs disk
#
# BATCH_DRY_RUN=1 prints each step's name, limit and command (one argument a line) and
# runs nothing: on any machine, what a call would run (tests/unit/test_batch_sh.py parses
# the bench steps' arguments with the benches' own parsers).
set -uo pipefail
out="${OUT:-/tmp/gpu-batch}"; mkdir -p "$out"; export OUT="$out"
export COLUMNS="${COLUMNS:-200}"  # rich tables in full in the logs, not cut at 80

clean() {  # what an earlier step or call left running (not this script's shells); a
  # launched SGLang server runs in its own session, so a killed service can leave it, and a
  # killed serve-ray its Ray (gcs_server, raylet, dashboard, the ray:: workers)
  local ours="^(/[^ ]*/)?python3? -m (rollout_service|bench|pytest|vllm|sglang)|^VLLM::|^sglang::"
  local ray="^ray::|/ray/(core/src/ray|dashboard|_private|autoscaler)/"
  pkill -9 -f "$ours|$ray" 2>/dev/null
  sleep 2
}

flatten() {  # flatten NAME: the device tool returns at most 8 files and no nested folders,
  # so the logs a step wrote below $out (servers', engines', pytest's basetemp) go into one
  # NAME-logs.tgz beside the step's own log (the H200's sglang-tests run wrote 13 files,
  # and its own log was among those left out)
  local name="$1" files
  files=$(cd "$out" && find . -mindepth 2 -type f \( -name '*.log' -o -name '*.json' \
    -o -name '*.txt' -o -name '*.xml' \) | sort)
  [ -n "$files" ] && (cd "$out" && echo "$files" | tar -czf "$name-logs.tgz" -T -)
  find "$out" -mindepth 1 -type d -exec rm -rf {} + 2>/dev/null
}

errors() {  # the first error lines of the logs a failed step wrote (servers', engines')
  find "$out" -name '*.log' -newer "$out/.step-start" \
    | xargs -r grep -l -E "Traceback|ERROR|EngineDeadError" | while read -r f; do
    echo "-- $f"; grep -n -m 12 -E -A3 "Traceback|ERROR|Error:" "$f" | cut -c1-220
  done
}

step() {  # step NAME LIMIT_S COMMAND... (STEP_LIMIT_S overrides LIMIT_S: under the device's
  # time left, so that the step's logs are still packed when its command is stopped; a
  # call cut by the device tool itself loses the step's packed logs)
  local name="$1" limit="${STEP_LIMIT_S:-$2}" rc; shift 2
  if [ -n "${BATCH_DRY_RUN:-}" ]; then
    echo "== $name (limit ${limit}s)"; printf '%s\n' "$@"; echo "== end"; return 0
  fi
  clean
  touch "$out/.step-start"
  echo "== $name (limit ${limit}s)"
  STALL_S="${STALL_S:-150}" bash tools/gpu/with_stacks.sh "$out/$name.log" timeout "$limit" "$@"
  rc=$?
  echo "== $name: rc $rc"; tail -40 "$out/$name.log" | cut -c1-220
  [ "$rc" -eq 0 ] || errors | head -120
  flatten "$name"
}

for s in "$@"; do
  case "$s" in
    tests) STALL_S=100000 step tests 420 bash tools/gpu/run_gpu_tests.sh gpu-marked cuda-ipc \
             cuda-shm ;;
    spec-tests) STALL_S=100000 step spec-tests 580 bash tools/gpu/run_gpu_tests.sh spec-graphs ;;
    trainer) STALL_S=100000 step trainer 330 bash tools/gpu/run_gpu_tests.sh trainer ;;
    starts) ROUNDS=3 DEADLINE_S=120 step starts 300 bash tools/gpu/start_ab.sh spawn fork ;;
    serving) step serving 480 python3 -m bench.serving --model embedded:small \
               --concurrency 128,512 --max-tokens 256 --rounds 3 --waves 2 \
               --logs "$out/serving-logs" ;;
    serving-dialects)  # issue 25: the service's OpenAI and SGLang dialects beside its native
      # API, the in-process engine and `vllm serve` (one service process for the three)
      step serving-dialects 560 python3 -m bench.serving --model embedded:small \
        --concurrency 128,512 --max-tokens 256 --rounds 3 --waves 2 \
        --modes asyncllm,service,service-openai,service-sglang,vllm-server \
        --logs "$out/serving-dialects-logs" ;;
    sync) step sync 240 python3 -m bench.weight_sync --size 1b --device cuda \
            --modes cuda_ipc,cuda_ipc-unstaged,cuda_ipc-reload,shm,floor --rounds 9 ;;
    sync7b) step sync7b 540 python3 -m bench.weight_sync --size 7b --device cuda \
            --modes cuda_ipc,cuda_ipc-reload,floor --rounds 5 ;;
    load) step load 300 python3 -m bench.push_under_load --model embedded:1b \
            --transport cuda_ipc --concurrency 128 --rounds 3 --round-s 20 ;;
    spec|spec-skip)  # the same run, the drafter at K = 0 run (vLLM's way) or skipped
      step "$s" 540 python3 -m bench.speculation --model embedded:1b --draft-noise 0.1 \
        --k-max 3 --static-k 0,1,2 --concurrency 1,16,64 --max-tokens 256 --rounds 3 \
        --rollout-prompts 256 --rollout-max-tokens 512 --logs "$out/$s-logs" \
        --drafter-at-k0 "$([ "$s" = spec-skip ] && echo skip || echo run)" ;;
    spec-repro)  # the H200's illegal memory access: k=0 pinned at c=64 after c=16, kernels
      # launched synchronously so that the engine core's traceback names the faulting one
      step spec-repro 330 env CUDA_LAUNCH_BLOCKING=1 python3 -m bench.speculation \
        --model embedded:1b --draft-noise 0.1 --k-max 3 --static-k 0 --concurrency 16,64 \
        --max-tokens 256 --rounds 1 --rollout-prompts 0 --full-cuda-graphs as_is \
        --logs "$out/spec-repro-logs" ;;
    spec-repro-eager)  # the same without compile and CUDA graphs: are the graphs in it?
      step spec-repro-eager 200 env CUDA_LAUNCH_BLOCKING=1 python3 -m bench.speculation \
        --model embedded:1b --draft-noise 0.1 --k-max 3 --static-k 0 --concurrency 16,64 \
        --max-tokens 256 --rounds 1 --rollout-prompts 0 --eager \
        --logs "$out/spec-repro-eager-logs" ;;
    churn)  # random K schedules every 3 steps under 256 requests (bench/spec_churn.py)
      step churn 300 env CUDA_LAUNCH_BLOCKING="${BLOCKING:-1}" python3 -m bench.spec_churn \
        --model embedded:1b --k-max 3 --concurrency 256 --changes "${CHANGES:-1000}" \
        --drafter-at-k0 "${DRAFTER_AT_K0:-run}" ;;
    churn-modes)  # which graphs the illegal memory access needs, and vLLM alone
      for mode in PIECEWISE FULL_DECODE_ONLY; do
        step "churn-$mode" 200 python3 -m bench.spec_churn --model embedded:1b --k-max 3 \
          --concurrency 256 --changes 600 --cudagraph-mode "$mode"
      done
      step churn-static 240 python3 -m bench.spec_churn --model embedded:1b --k-max 3 \
        --concurrency 256 --static '[[1,250,3],[251,1024,1]]' --requests 6000 ;;
    churn-pin)  # one K pinned before any request, then no change: uniform decodes sweep the
      # batch from 256 down at query length K + 1 with vLLM's capture sizes. The mechanism
      # of docs/speculation-control.md (the drafter replays a FULL graph of more requests
      # than the target ran) predicts a crash at K = 1 and none at K = 2; the engine's log
      # names the batch sizes at risk (graph_policy.warn_divergence)
      for k in 1 2; do
        step "churn-pin-k$k" 200 env CUDA_LAUNCH_BLOCKING=1 python3 -m bench.spec_churn \
          --model embedded:1b --k-max 3 --concurrency 256 --pin "{\"1\": $k}" --requests 512 \
          --prompt-tokens 8,64 --max-tokens 128,256
      done ;;
    churn-pin-static)  # vLLM alone, the same load, K = 1 from 4 requests on (K 2, 3 below it
      # so that every query length is captured, as with the project's start-up schedule)
      step churn-pin-static 200 env CUDA_LAUNCH_BLOCKING=1 python3 -m bench.spec_churn \
        --model embedded:1b --k-max 3 --concurrency 256 \
        --static '[[1,1,0],[2,2,2],[3,3,3],[4,1024,1]]' --requests 512 \
        --prompt-tokens 8,64 --max-tokens 128,256 ;;
    churn-upstream)  # vLLM alone (no project code in its processes), K = 1 from 32 requests
      # on: 33 requests in flight, a batch whose drafter replays a FULL graph of 36 requests
      # on the target's metadata for 33 (strict xfail: vLLM dies there), then 32 (clean).
      # The upstream-only reproducer of docs/speculation-control.md
      # (-s: pytest prints nothing of an xfailed test, and its report says how it failed)
      STALL_S=100000 step churn-upstream 540 python3 -m pytest -q -s -p no:cacheprovider -m gpu \
        -rA tests/integration/rollout_service/test_vllm_graph_divergence.py ;;
    churn-align)  # the random churn with the service's aligned capture sizes
      # (speculation_control.full_cuda_graphs: align, the default), outside pytest
      # (BLOCKING=1 launches kernels synchronously: 1000 changes then take over 300 s)
      step churn-align 300 env CUDA_LAUNCH_BLOCKING="${BLOCKING:-0}" python3 -m bench.spec_churn \
        --model embedded:1b --k-max 3 --concurrency 256 --changes "${CHANGES:-1000}" \
        --full-cuda-graphs align ;;
    churn-tests) STALL_S=100000 step churn-tests 560 python3 -m pytest -q -p no:cacheprovider \
        -m gpu -rA tests/integration/rollout_service/test_spec_churn.py ;;
    spec-ab)  # drafter_at_k0 run vs skip: k=0 against spec-off on one run, 3 engines
      step spec-ab 570 python3 -m bench.speculation --model embedded:1b --draft-noise 0.1 \
        --k-max 3 --static-k 0 --concurrency 16,64 --max-tokens 256 --rounds 5 \
        --rollout-prompts 0 --drafter-at-k0 run,skip --logs "$out/spec-ab-logs" ;;
    spec-bench)  # the issue's benchmark, one drafter a call (NOISE, default 0.1; STALE=1:
      # that drafter made stale instead; STALE=also: the fresh runs, then the first noise's
      # drafter made stale): c = LEVELS (1,16,64,256) and the decaying rollout
      # of PROMPTS (512; 0: none; LEVELS= empty: the rollout alone), to split a drafter
      # over two calls if one is too long; NOISE=0.3,0.6: drafters pushed one after another
      # on the same services (a step log named spec-bench-0.3_0.6);
      # DRAFTER_AT_K0=run,skip: both controllers (a third engine). Three engines on an H100
      # need two calls: LEVELS=1,16,64 PROMPTS=0, then LEVELS=256 (c = 1..64 took the whole
      # 570 s at 91b7212); `python -m bench.speculation_log` reads both logs into one report.
      # CAPTURE_TOKENS (vLLM's max_cudagraph_capture_size for every engine; by default
      # vLLM's 512 for spec-off and the service's (k_max + 1) x 512 for the controlled
      # engine) and CALIBRATE_TO (the calibration's largest batch, 32 by default; 256 took
      # 4.9 s on an H100). ROUNDS (3) and WAVES (3: a round keeps c in flight for 3c
      # requests, and runs the rollout 3 times back to back; at 1 a round of c = 16 took
      # under a second, and spec-off alone spread 5324-7851 tok/s over 3 rounds on an H100,
      # at 3 7550-7770 over 4; c = 256 and the rollout at 1 took 425 s with the starts).
      # STATIC_K (0,1,2,3): the pinned K modes; STATIC_K=0 keeps only the floor, for the
      # controller / spec-off target of a drafter in one call. FROZEN=1: one more mode, the
      # controller's own schedule pinned before each round (what its deciding costs)
      noise="${NOISE:-0.1}" stale=()
      case "${STALE:-}" in "") ;; also) stale=(--stale-drafter) ;; *) stale=(--stale-only) ;; esac
      step "spec-bench-${noise//,/_}${STALE:+-stale}" 570 python3 -m bench.speculation \
        --model embedded:1b --draft-noise "$noise" --k-max 3 \
        --concurrency "${LEVELS-1,16,64,256}" --max-tokens 256 --rounds "${ROUNDS:-3}" \
        --waves "${WAVES:-3}" \
        --rollout-prompts "${PROMPTS:-512}" --rollout-max-tokens 1024 \
        --drafter-at-k0 "${DRAFTER_AT_K0:-auto}" "${stale[@]}" \
        ${STATIC_K:+--static-k "$STATIC_K"} ${FROZEN:+--frozen} \
        ${CAPTURE_TOKENS:+--max-capture-tokens "$CAPTURE_TOKENS"} \
        ${CALIBRATE_TO:+--calibration-max-batch-size "$CALIBRATE_TO"} \
        --logs "$out/spec-bench-logs" ;;
    spec-floor)  # where the K = 0 floor goes: both engines' kernels per generated token
      # (bench/step_profile.py); the traces stay on the machine, the table is in the log
      step spec-floor 420 python3 -m bench.step_profile --model embedded:1b \
        --batch "${BATCH:-256}" --tokens 128 --rounds "${ROUNDS:-3}" \
        --drafter-at-k0 "${DRAFTER_AT_K0:-auto}" --max-capture-tokens "${CAPTURE_TOKENS:-2048}" \
        --profile-dir "/tmp/step-profile-$$" ;;
    spec-profile) step spec-profile 420 python3 -m bench.speculation --model embedded:1b \
            --draft-noise 0.1 --k-max 3 --static-k 0,1 --concurrency 16 --max-tokens 256 \
            --rounds 2 --rollout-prompts 0 --profile-modes spec-off,k=0 \
            --profile-dir "$out/spec-profiles" --logs "$out/spec-logs" ;;
    sglang-smoke)  # service-1b too: SMOKE_SKIP= (about 1.5 min more)
      step sglang-smoke 540 python3 -m bench.sglang_smoke --logs "$out/sglang-smoke-logs" \
        --skip "${SMOKE_SKIP-service-1b}" ;;
    sglang-tests)  # the service tests on a live SGLang; every log under $out (--basetemp)
      STALL_S=100000 step sglang-tests 540 env ROLLOUT_TEST_TARGET=sglang python3 -m pytest -q \
        -p no:cacheprovider -rfEs --basetemp "$out/sglang-tests-tmp" \
        --junitxml "$out/sglang-tests.xml" \
        tests/integration/rollout_service/test_sglang_live.py \
        tests/integration/rollout_service/test_api.py \
        tests/integration/rollout_service/test_weights.py \
        tests/integration/rollout_service/test_weights_refused.py \
        tests/integration/rollout_service/test_openai.py \
        tests/integration/rollout_service/test_engine_start.py \
        tests/integration/rollout_service/test_no_speculation.py ;;
    sglang-serving)  # ROUNDS (3) x WAVES (2): about 5 x 2 fit the limit on an H100 (the 3
      # starts take ~300 s, a round of 2 waves ~30 s at 512 and ~8 s at 128 for the 3 modes;
      # LEVELS=512 ROUNDS=4 took 480 s; MODES=service,sglang-server LEVELS=512 ROUNDS=6 289 s).
      # MODES=service,sglang-server drops the dialect's mode (it costs the service what the
      # native one does, bench.front_end): 1/3 more rounds. SGLANG_KWARGS='{"k": v}': more
      # launch_server arguments of both servers ('{"tokenizer_worker_num": 2}': SGLang's own
      # front end in two processes). MODEL (embedded:small): another checkpoint
      # (MODEL=embedded:1b MODES=service,sglang-server LEVELS=512 ROUNDS=4: 460 s on an H100)
      step sglang-serving 540 python3 -m bench.serving --engine sglang \
        --model "${MODEL:-embedded:small}" --concurrency "${LEVELS:-128,512}" --max-tokens 256 \
        --rounds "${ROUNDS:-3}" --waves "${WAVES:-2}" ${MODES:+--modes "$MODES"} \
        ${SGLANG_KWARGS:+--sglang-kwargs "$SGLANG_KWARGS"} --logs "$out/sglang-serving-logs" ;;
    sglang-serving-128)  # 128 in flight only, 9 rounds: rounds are short (2 waves, ~3 s a
      # mode) beside the servers' start, and 3 rounds spread wider than any gap
      step sglang-serving-128 540 python3 -m bench.serving --engine sglang \
        --model embedded:small --concurrency 128 --max-tokens 256 --rounds 9 --waves 2 \
        --logs "$out/sglang-serving-logs" ;;
    sglang-serving-long)  # the 128 gap of sglang-serving with rounds 4x as long (8 waves:
      # is it the rounds' ramp and tail?) and the service's process under py-spy
      step sglang-serving-long 540 python3 -m bench.serving --engine sglang \
        --model embedded:small --concurrency 128 --max-tokens 256 --rounds 3 --waves 8 \
        --profile-service "$out/sglang-serving-profile" --logs "$out/sglang-serving-logs" ;;
    sglang-serving-mixed)  # 128 in flight, lengths spread +-50% (mean 256): requests that
      # do not all end in one engine step, so their replacements do not reach SGLang as a burst;
      # LEVELS=512 MODES=service,sglang-server ROUNDS=5: the 512 gap on the lengths of a
      # rollout; MODEL as sglang-serving's
      step sglang-serving-mixed 540 python3 -m bench.serving --engine sglang \
        --model "${MODEL:-embedded:small}" --concurrency "${LEVELS:-128}" --max-tokens 256 \
        --length-spread 0.5 --rounds "${ROUNDS:-3}" --waves 4 ${MODES:+--modes "$MODES"} \
        ${SGLANG_KWARGS:+--sglang-kwargs "$SGLANG_KWARGS"} --logs "$out/sglang-serving-logs" ;;
    sglang-ipc-tests)  # test_sglang_cuda_ipc_live.py: its own SGLang server (tiny) and a
      # cuda_ipc service on it; staged and in-place pushes of main + drafter, a refused one
      STALL_S=100000 step sglang-ipc-tests 360 env ROLLOUT_TEST_TARGET=sglang python3 -m pytest \
        -q -p no:cacheprovider -rfEs --basetemp "$out/sglang-ipc-tests-tmp" \
        --junitxml "$out/sglang-ipc-tests.xml" \
        tests/integration/rollout_service/test_sglang_cuda_ipc_live.py ;;
    sglang-nccl-tests)  # test_sglang_nccl_live.py, TWO GPUs: SGLang on GPU 0, the trainer's
      # NCCL rank on GPU 1 (the project's WeightPusher, transport nccl); skipped on one GPU
      STALL_S=100000 step sglang-nccl-tests 360 env ROLLOUT_TEST_TARGET=sglang python3 -m \
        pytest -q -p no:cacheprovider -rfEs --basetemp "$out/sglang-nccl-tests-tmp" \
        --junitxml "$out/sglang-nccl-tests.xml" \
        tests/integration/rollout_service/test_sglang_nccl_live.py ;;
    sglang-dialect-tests)  # test_dialect_weights.py: slime's sync (SGLang's
      # /init_weights_update_group + /update_weights_from_distributed over gloo) into a
      # service-launched SGLang: loads, refusals, a second trainer, a trainer that dies
      STALL_S=100000 step sglang-dialect-tests 420 env ROLLOUT_TEST_TARGET=sglang python3 -m \
        pytest -q -p no:cacheprovider -rfEs --basetemp "$out/sglang-dialect-tests-tmp" \
        --junitxml "$out/sglang-dialect-tests.xml" \
        tests/integration/rollout_service/test_dialect_weights.py ;;
    sglang-sync) step sglang-sync 420 python3 -m bench.weight_sync_sglang --size 1b \
        --rounds 5 ;;
    rayserve)  # the Ray Serve ingress, 2 engine replicas on the one GPU (num_gpus 0.5, half of
      # the service's gpu_memory_utilization each, engines started one after the other) vs the
      # standalone service on the whole share (0.25), interleaved as in `serving`: 3 engines
      # to start (~1 min each with compile and graphs), ~3 min of rounds at 512 (529 s of
      # the 550 this step had on the H100)
      step rayserve 580 python3 -m bench.serving --model embedded:small --modes service,ray-serve \
        --ray-replicas 2 --concurrency 128,512 --max-tokens 256 --rounds 3 --waves 2 \
        --logs "$out/rayserve-logs" ;;
    rayserve-load)  # 100 pushes of main + drafter (shm: NCCL puts no two ranks on one GPU)
      # through the Ray ingress, 2 replicas at 0.25 each, under 128 requests in flight, as
      # `load` does standalone: Ray and 2 engine starts (1b; ~4 min on the H100), a 5 s
      # warm-up pair, then pairs of 20 s rounds until the 100th push (~1.1 s a push on the
      # H100: 6 pairs). A run cut by the limit still prints the rounds it finished.
      step rayserve-load 580 python3 -m bench.push_under_load --model embedded:1b \
        --ray-replicas 2 --transport shm --concurrency 128 --pushes 100 --round-s 20 \
        --warmup-s 5 --logs "$out/rayserve-load-logs" ;;
    spec-full) step spec-full 540 python3 -m bench.speculation --model embedded:1b \
            --draft-noise 0.1,0.6 --k-max 3 --concurrency 1,16,256 --max-tokens 256 \
            --rounds 2 --rollout-prompts 512 --stale-drafter --logs "$out/spec-logs" ;;
    *) echo "unknown step: $s (tests spec-tests trainer starts serving serving-dialects sync sync7b load spec spec-skip spec-profile spec-floor spec-full spec-repro spec-repro-eager churn churn-modes churn-pin churn-pin-static churn-upstream churn-align churn-tests spec-ab spec-bench sglang-smoke sglang-tests sglang-ipc-tests sglang-nccl-tests sglang-dialect-tests sglang-serving sglang-serving-128 sglang-serving-long sglang-serving-mixed sglang-sync rayserve rayserve-load)" >&2; exit 2 ;;
  esac
done
[ -n "${BATCH_DRY_RUN:-}" ] || clean
