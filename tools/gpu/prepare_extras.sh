#!/usr/bin/env bash
# Run on the CPU machine, in the project root, before a GPU session. Fetches what the
# project's GPU tests and benchmarks need beyond the vllm bundle (tools/gpu/bundle, vLLM CUDA):
# the test and CLI dependencies as CPython 3.12 wheels, py-spy, uvloop and httptools (the
# service's uvicorn names both), and the
# Prometheus server binary (the GPU machine has no registry). Everything goes into
# .gpuextra/ (git-ignored through .git/info/exclude), ~30 MB: carry it in the call
# that sources project_env.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .gpuextra
grep -qxF "/.gpuextra/" .git/info/exclude || echo "/.gpuextra/" >> .git/info/exclude
python3 -m pip download -q --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_28_x86_64 -d .gpuextra \
  pytest pytest-asyncio pytest-timeout hypothesis openai typer rich httpx py-spy uvloop \
  httptools \
  psutil pyyaml aiohttp httpx-aiohttp
command -v prometheus >/dev/null || { echo "install Debian's prometheus first" >&2; exit 1; }
xz -T0 -c "$(command -v prometheus)" > .gpuextra/prometheus.xz
du -sh .gpuextra
