#!/usr/bin/env bash
# On the GPU machine, after `source tools/gpu/project_env.sh`: the service's
# integration tests on vLLM's CUDA build, once per target given (ROLLOUT_TEST_TARGET of
# tests/integration/conftest.py; default: cuda-shm cuda-ipc cuda-ipc-reload gpu-marked),
# and the gpu-marked tests. Logs go to $OUT (or
# /tmp/gpu-tests); prints each run's summary. One target takes ~3-5 minutes.
#
#   source tools/gpu/project_env.sh && bash tools/gpu/run_gpu_tests.sh cuda-shm
set -uo pipefail
out="${OUT:-/tmp/gpu-tests}"
mkdir -p "$out"
service_tests="tests/integration/rollout_service/test_api.py tests/integration/rollout_service/test_weights.py"
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(cuda-shm cuda-ipc cuda-ipc-reload gpu-marked)
for target in "${targets[@]}"; do
  if [ "$target" = gpu-marked ]; then
    timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu --noconftest \
      tests/integration/rollout_service/test_cuda_ipc_gpu.py > "$out/$target.log" 2>&1
  else
    ROLLOUT_TEST_TARGET=$target timeout 500 python3 -m pytest -q -p no:cacheprovider \
      $service_tests > "$out/$target.log" 2>&1
  fi
  echo "== $target (rc $?): $(tail -1 "$out/$target.log")"
done
