#!/usr/bin/env bash
# Run a command on the GPU machine; whenever its log has not grown for STALL_S seconds,
# write every Python stack of the machine (py-spy; vLLM engine cores and SGLang's
# schedulers too) next to the log, once per stall.
# For engine starts that hang silently (docs/what-ran-where.md): the stacks show where.
#
#   STALL_S=120 bash tools/gpu/with_stacks.sh $OUT/serving.log python3 -m bench.serving ...
set -uo pipefail
log="$1"; shift
stall_s="${STALL_S:-120}"
mkdir -p "$(dirname "$log")"
"$@" > "$log" 2>&1 &
child=$!
last_size=-1; still=0; dumps=0
while kill -0 "$child" 2>/dev/null; do
  sleep 5
  size=$(stat -c %s "$log" 2>/dev/null || echo 0)
  if [ "$size" != "$last_size" ]; then last_size=$size; still=0; continue; fi
  still=$((still + 5))
  if [ "$still" -ge "$stall_s" ]; then
    dumps=$((dumps + 1)); out="${log%.*}.stacks-$dumps.txt"
    for p in $(pgrep -f "python|VLLM|sglang::"); do
      echo "=== pid $p: $(tr '\0' ' ' < /proc/$p/cmdline | cut -c1-160)"
      timeout 20 py-spy dump --pid "$p" 2>&1 | head -80
    done > "$out"
    echo "with_stacks: no output for ${still}s; stacks in $out" >&2
    still=-100000  # once per stall: re-armed when the log grows again
  fi
done
wait "$child"
