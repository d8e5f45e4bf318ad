#!/usr/bin/env bash
# Diagnose engine starts that hang when several vLLM engines start at once on one GPU:
# starts N services (embedded tiny, eager) together, waits for each /health up to a
# deadline, then dumps every Python stack (py-spy) of the ones that did not come up.
#   source tools/gpu/project_env.sh && bash tools/gpu/concurrent_start.sh 2 120
set -uo pipefail
n="${1:-2}"; deadline_s="${2:-120}"; out="${OUT:-/tmp/concurrent-start}"; mkdir -p "$out"
pids=()
for i in $(seq 1 "$n"); do
  port=$((18000 + i))
  printf '{"model": "embedded:tiny", "port": %d, "engine_kwargs": {"gpu_memory_utilization": 0.2, "enforce_eager": true}}' "$port" > "$out/service-$i.json"
  python3 -m rollout_service.cli serve --config "$out/service-$i.json" > "$out/service-$i.log" 2>&1 &
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
