#!/usr/bin/env bash
# CPU machine, after tools/gpu/prepare_ray.sh: install the staged Ray parts the way the GPU
# machine will, as far as this machine can. A fresh CPython 3.12 venv stands in for the image's
# python3 (set PYTHON312 to a 3.12 interpreter); the packages the GPU machine has without the
# Ray parts (the vllm bundle's pins, .gpuextra's, the image's at the resolved versions: the
# image's own are mostly unknown) go into a throwaway folder from the registry, standing in
# for project_env.sh's PYTHONPATH; then tools/gpu/ray_env.sh is sourced once per part, each
# time in a folder that holds only that part (as one device call carries one), with
# throwaway RAY_STORE and RAY_SITE. The second call installs and runs ray_check.py --smoke.
# Not checked here: the image's real versions, the GPU (Ray's GPU count, fractional
# placement), and the vllm bundle's packages beyond the ones Ray Serve needs.
#
#   PYTHON312=/path/to/python3.12 bash tools/gpu/ray_local_check.sh     # ~2 minutes
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
py="${PYTHON312:-python3.12}"
"$py" -c 'import sys; assert sys.version_info[:2] == (3, 12)' \
  || { echo "set PYTHON312 to a CPython 3.12 interpreter" >&2; exit 1; }
ls .gpuray/r*/PART > /dev/null || { echo "run tools/gpu/prepare_ray.sh first" >&2; exit 1; }
tmp=$(mktemp -d /tmp/ray-local-check.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
"$py" -m venv "$tmp/venv"
version=$(sed -n 's/^ray==\([^ ]*\) .*/\1/p' tools/gpu/ray-lock.txt)
echo "== resolving ray[serve]==$version for cp312 (the lock's resolution)"
.venv/bin/python -m pip install -q --dry-run --ignore-installed --target "$tmp/x" \
  --report "$tmp/report.json" --only-binary=:all: --python-version 3.12 \
  --implementation cp --abi cp312 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 "ray[serve]==$version"
.venv/bin/python tools/gpu/ray_lock.py "$tmp/report.json" --provided > "$tmp/provided.txt" \
  2> "$tmp/provided.log"
echo "== $(wc -l < "$tmp/provided.txt") stand-ins for the vllm bundle, the image and .gpuextra"
"$tmp/venv/bin/python" -m pip install -q --no-deps --only-binary=:all: --target "$tmp/site" \
  -r "$tmp/provided.txt"
for part in .gpuray/r*/; do
  name=$(basename "$part")
  echo "== call with $name"
  rm -rf "$tmp/call" && mkdir -p "$tmp/call/.gpuray" "$tmp/call/tools"
  ln -s "$root/tools/gpu" "$tmp/call/tools/gpu"
  ln -s "$root/.gpuray/$name" "$tmp/call/.gpuray/$name"
  (cd "$tmp/call" && env PATH="$tmp/venv/bin:$PATH" PYTHONPATH="$tmp/site" \
    RAY_STORE="$tmp/store" RAY_SITE="$tmp/raysite" \
    bash -c 'source tools/gpu/ray_env.sh && echo "PYTHONPATH=$PYTHONPATH"')
done
echo "== a later call (both part folders still there, as the device keeps ignored paths)"
for part in .gpuray/r*/; do ln -sfn "$root/$part" "$tmp/call/.gpuray/$(basename "$part")"; done
(cd "$tmp/call" && env PATH="$tmp/venv/bin:$PATH" PYTHONPATH="$tmp/site" \
  RAY_STORE="$tmp/store" RAY_SITE="$tmp/raysite" bash -c \
  'source tools/gpu/ray_env.sh && python3 -c "import ray, ray.serve; print(\"import ray, ray.serve: ok,\", ray.__version__, ray.__file__)"')
echo "ray local check: ok"
