#!/usr/bin/env bash
# On the GPU machine, after `source tools/gpu/project_env.sh`: the service's
# integration tests on vLLM's CUDA build, once per target given (ROLLOUT_TEST_TARGET of
# tests/integration/conftest.py; default: cuda-shm cuda-ipc cuda-ipc-k1 cuda-ipc-reload
# gpu-marked), the gpu-marked tests, `trainer` (the megatron-core 0.19 tests, .whl/
# carried) and `spec-graphs` (the speculation control's tests with CUDA graphs). Logs go to $OUT (or /tmp/gpu-tests); prints each run's summary. A service
# target took 76 s on an H200 (cuda-ipc, 2026-12-01).
#
#   source tools/gpu/project_env.sh && bash tools/gpu/run_gpu_tests.sh cuda-shm
set -uo pipefail
out="${OUT:-/tmp/gpu-tests}"
mkdir -p "$out"
service_tests="tests/integration/rollout_service/test_api.py tests/integration/rollout_service/test_weights.py tests/integration/rollout_service/test_weights_refused.py"
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(cuda-shm cuda-ipc cuda-ipc-k1 cuda-ipc-reload gpu-marked)
for target in "${targets[@]}"; do
  if [ "$target" = trainer ]; then
    # megatron-core travels as a wheel in .whl/ (carry it; see docs/what-ran-where.md)
    if [ ! -d /tmp/megsite ]; then
      python3 -m pip install -q --no-index --no-deps --target /tmp/megsite .whl/megatron_core-*.whl
    fi
    PYTHONPATH="/tmp/megsite:$PYTHONPATH" timeout 500 python3 -m pytest -q -p no:cacheprovider \
      -m gpu -rA tests/integration/trainer_client/test_gpu.py > "$out/$target.log" 2>&1
  elif [ "$target" = spec-graphs ]; then
    # The speculation control on vLLM's compile + CUDA graphs (model runner V2): every K
    # pinned at batch sizes across the start-up schedule's tiers. For the line that
    # faults, run it again with CUDA_LAUNCH_BLOCKING=1 in the environment.
    ROLLOUT_TEST_TARGET=cuda-graphs STALL_S=300 bash tools/gpu/with_stacks.sh "$out/$target.log" \
      timeout 560 python3 -m pytest -q -p no:cacheprovider \
      tests/integration/rollout_service/test_speculation_control.py
  elif [ "$target" = gpu-marked ]; then
    timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu --noconftest \
      tests/integration/rollout_service/test_cuda_ipc_gpu.py > "$out/$target.log" 2>&1
  else
    # A blocked engine start ends within the targets' engine_start_timeout_s (180 s);
    # with_stacks.sh dumps every Python stack before that, for the why.
    ROLLOUT_TEST_TARGET=$target STALL_S=150 bash tools/gpu/with_stacks.sh "$out/$target.log" \
      timeout 500 python3 -m pytest -q -p no:cacheprovider $service_tests
  fi
  echo "== $target (rc $?): $(tail -1 "$out/$target.log")"
done
