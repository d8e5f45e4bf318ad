#!/usr/bin/env bash
# Diagnose engine starts that hang when several vLLM engines start at once on one GPU:
# starts N services (embedded tiny, eager) together, waits for each /health up to a
# deadline, then dumps every Python stack (py-spy) of the ones that did not come up.
# Knobs (environment), for A/B runs of the candidate causes in docs/what-ran-where.md:
#   EAGER=0     vLLM's default torch.compile + CUDA graphs (the hung bench.serving run)
#   ISOLATE=1   spawn instead of fork, one VLLM_CACHE_ROOT / TRITON_CACHE_DIR per service,
#               inductor file locks time out after 180 s
#   V1_RUNNER=1 VLLM_USE_V2_MODEL_RUNNER=0
#   source tools/gpu/project_env.sh && bash tools/gpu/concurrent_start.sh 2 120
#   EAGER=0 ISOLATE=1 bash tools/gpu/concurrent_start.sh 4 400
set -uo pipefail
n="${1:-2}"; deadline_s="${2:-120}"; out="${OUT:-/tmp/concurrent-start}"; mkdir -p "$out"
eager=$([ "${EAGER:-1}" = 0 ] && echo false || echo true)
echo "services $n, deadline ${deadline_s}s, eager $eager, isolate ${ISOLATE:-0}, v1 runner ${V1_RUNNER:-0}"
pids=()
for i in $(seq 1 "$n"); do
  port=$((18000 + i))
  printf '{"model": "embedded:tiny", "port": %d, "engine_kwargs": {"gpu_memory_utilization": 0.15, "enforce_eager": %s}}' "$port" "$eager" > "$out/service-$i.json"
  env_i=()
  if [ "${ISOLATE:-0}" = 1 ]; then
    cache="/tmp/vllm-cache-$i"; mkdir -p "$cache/triton"
    env_i+=(VLLM_WORKER_MULTIPROC_METHOD=spawn VLLM_CACHE_ROOT="$cache"
            TRITON_CACHE_DIR="$cache/triton" TORCHINDUCTOR_FILE_LOCK_TIMEOUT=180)
  fi
  [ "${V1_RUNNER:-0}" = 1 ] && env_i+=(VLLM_USE_V2_MODEL_RUNNER=0)
  env "${env_i[@]}" python3 -m rollout_service.cli serve --config "$out/service-$i.json" \
    > "$out/service-$i.log" 2>&1 &
  pids+=($!)
done
start=$(date +%s)
for i in $(seq 1 "$n"); do
  port=$((18000 + i))
  until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do
    if [ $(( $(date +%s) - start )) -ge "$deadline_s" ]; then
      echo "service $i: not healthy after ${deadline_s}s"; break
    fi
    sleep 1
  done
  echo "service $i: done waiting at $(( $(date +%s) - start ))s"
done
for p in $(pgrep -f "rollout_service.cli serve|VLLM|EngineCore"); do
  echo "=== pid $p: $(tr '\0' ' ' < /proc/$p/cmdline | cut -c1-120)"
  timeout 20 py-spy dump --pid "$p" 2>&1 | head -60
done > "$out/stacks.txt"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
kill "${pids[@]}" 2>/dev/null; sleep 3; pkill -9 -f "VLLM|EngineCore|rollout_service.cli" 2>/dev/null
echo "stacks in $out/stacks.txt"
