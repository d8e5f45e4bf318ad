#!/usr/bin/env bash
# local_check.sh BUNDLE -- on the CPU machine, after prepare.sh: install the staged parts the way the
# GPU machine does and run the CPU part of the bundle's smoke test (imports, `--help`).
#   bash tools/gpu/bundle/local_check.sh sglang
# 1. check_reqs.py lock: every locked wheel installs on cp312 manylinux x86_64 and its requirements
#    are met by the lock, the image (image-packages.txt) or pruned.txt;
# 2. an "image" venv: CPython 3.12 ($PYTHON312, python3.12 or pyenv's 3.12) with PyPI stand-ins
#    for the packages the bundle leaves to the image (no torch, no CUDA libraries);
# 3. device_step.sh for every staged part, installing under $GPU_BUNDLE_CACHE/check-BUNDLE/, with
#    stub CUDA libraries (cuda_stubs.py) and SMOKE_CPU=1.  Takes ~10-20 minutes on 2 cores.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
NAME=${1:?usage: local_check.sh BUNDLE}
PROJ=$(git rev-parse --show-toplevel)
OUT=$PROJ/.gpu-$NAME
CACHE=${GPU_BUNDLE_CACHE:-$(dirname "$PROJ")/.cache-gpu-bundles}
T=$CACHE/check-$NAME
[ -f "$OUT/manifest.txt" ] || { echo "local_check.sh: run prepare.sh $NAME first" >&2; exit 1; }
PY312=${PYTHON312:-}
if [ -z "$PY312" ]; then
  if python3.12 -V >/dev/null 2>&1; then PY312=python3.12
  else PY312=$(PYENV_VERSION=$(pyenv versions --bare 2>/dev/null | grep '^3\.12' | tail -1) pyenv which python3.12); fi
fi

echo "== 1. requirements of the lock"
IMAGE_REQS_OUT=$T.image-reqs python3 "$HERE/check_reqs.py" lock "$HERE/$NAME" "$CACHE/wheels" "$HERE/image-packages.txt" \
  | grep -v '^IMAGE VERSION' || true

echo "== 2. image stand-ins in $T/venv"
mkdir -p "$T"
if [ ! -x "$T/venv/bin/python3" ] || ! cmp -s "$T.image-reqs" "$T/venv/.reqs"; then
  rm -rf "$T/venv" && "$PY312" -m venv "$T/venv"
  # the closure of the image's packages, less what the bundle carries and torch's CUDA stack
  sed 's/==.*//' "$T.image-reqs" | grep -v -x -E 'torch|triton|torchvision|torchaudio|cuda-toolkit|nvidia-(cu|nccl|nvshmem|nvjitlink|nvtx).*' > "$T/names"
  "$T/venv/bin/python3" -m pip install -q --dry-run --ignore-installed --report "$T/report.json" -r "$T/names" 2>/dev/null
  "$T/venv/bin/python3" - "$T/report.json" "$HERE/$NAME" > "$T/standins" <<'PY'
import glob, json, re, sys
canon = lambda n: re.sub(r'[-_.]+', '-', n).lower()
locked = {canon(l.split('==')[0]) for f in glob.glob(sys.argv[2] + '/lock-*.txt') for l in open(f) if '==' in l and not l.startswith('#')}
for i in json.load(open(sys.argv[1]))['install']:
    n = canon(i['metadata']['name'])
    if n not in locked and not re.match(r'(torch|triton|cuda-toolkit|nvidia-(cu|nccl|nvshmem|nvjitlink|nvtx))', n):
        print(f"{i['metadata']['name']}=={i['metadata']['version']}")
PY
  "$T/venv/bin/python3" -m pip install -q --no-deps -r "$T/standins" 2>&1 | grep -v 'is ignored' || true
  cp "$T.image-reqs" "$T/venv/.reqs"
fi
echo "   $(wc -l < "$T/standins") stand-in packages"

echo "== 3. the parts, as on the GPU machine"
rm -rf "$T/root" "$T/store" && mkdir -p "$T/root"
step() {  # device_step.sh of one part, installing under $T/root
  GPU_BUNDLE_PREFIX=$T/root GPU_BUNDLE_STORE=$T/store PYTHON=$T/venv/bin/python3 SMOKE_CPU=1 \
    bash "$OUT/$1/device_step.sh"
}
ids=$(awk '$1=="PART"{print $2}' "$OUT/manifest.txt")
: > "$T/step.log"
for id in $ids; do step "$id" >> "$T/step.log" 2>&1 || true; done
grep -E 'installed in|failed|mismatch|differs' "$T/step.log" "$T"/store/*/pip.log 2>/dev/null || true
# this machine has no CUDA libraries: stand-ins built from what the installed bundle imports
python3 "$HERE/cuda_stubs.py" $(sed -n 's/^PIECES="\(.*\)"/\1/p' "$HERE/$NAME/bundle.env" | tr ' ' '\n' \
  | sed "s|.*:|$T/root|") "$T/venv" "$T/stubs" | tr '\n' ';'; echo
echo "== 4. the smoke test's CPU part (the last part's call again, now with the stand-ins)"
LD_LIBRARY_PATH=$T/stubs step "$(tail -1 <<<"$ids")"
