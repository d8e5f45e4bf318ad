#!/usr/bin/env bash
# On the GPU machine, after `source tools/gpu/project_env.sh`: start the service (embedded
# tiny, eager) ROUNDS times per variant, the variants interleaved round by round, one
# start at a time, and print how long each took to serve or that it did not within
# DEADLINE_S (the service's engine_start_timeout_s then stops it and exits naming it).
# For the engine-core start that blocked in a pinned host allocation of vLLM's V2 model
# runner (docs/what-ran-where.md). Variants:
#   spawn   the service's default on CUDA (engine core spawned: start_method.py)
#   fork    VLLM_WORKER_MULTIPROC_METHOD=fork (vLLM's own default, the blocked starts)
#   v1      forked, VLLM_USE_V2_MODEL_RUNNER=0
#
#   ROUNDS=4 DEADLINE_S=120 bash tools/gpu/start_ab.sh spawn fork v1
set -uo pipefail
rounds="${ROUNDS:-3}"; deadline_s="${DEADLINE_S:-120}"; out="${OUT:-/tmp/start-ab}"
mkdir -p "$out"
variants=("$@"); [ ${#variants[@]} -eq 0 ] && variants=(spawn fork)
printf '{"model": "embedded:tiny", "engine_start_timeout_s": %s, "engine_kwargs": {"gpu_memory_utilization": 0.15, "enforce_eager": true}}' \
  "$deadline_s" > "$out/service.json"
printf '%-6s %-6s %s\n' round variant result
for r in $(seq 1 "$rounds"); do
  for v in "${variants[@]}"; do
    env_v=()
    case "$v" in
      fork) env_v=(VLLM_WORKER_MULTIPROC_METHOD=fork) ;;
      v1) env_v=(VLLM_WORKER_MULTIPROC_METHOD=fork VLLM_USE_V2_MODEL_RUNNER=0) ;;
    esac
    log="$out/$v-$r.log"; port=$((18100 + r))
    start_ns=$(date +%s%N)
    env "${env_v[@]}" python3 -m rollout_service.cli serve --config "$out/service.json" \
      --port "$port" > "$log" 2>&1 &
    pid=$!
    result="exited"
    while kill -0 "$pid" 2>/dev/null; do
      if curl -sf "http://127.0.0.1:$port/health" > /dev/null; then
        result="$(( ($(date +%s%N) - start_ns) / 1000000 )) ms"; break
      fi
      sleep 0.5
    done
    grep -q "engine_start_timeout_s: the engine did not start" "$log" && result="past ${deadline_s} s"
    printf '%-6s %-6s %s\n' "$r" "$v" "$result"
    kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
    pkill -9 -f "VLLM::EngineCore" 2>/dev/null  # nothing of this start may meet the next
  done
done
