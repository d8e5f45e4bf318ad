#!/usr/bin/env bash
# Run on the CPU machine, in the project root, before a GPU session that runs Ray Serve
# (batch.sh rayserve, rayserve-load). The GPU machine has no Ray and no package registry, and
# Ray is in neither the vllm bundle nor the image: this downloads the wheels of
# tools/gpu/ray-lock.txt (Ray, 76 MiB, and the 18 wheels Ray Serve needs there that the vllm
# bundle's lock, the image and .gpuextra lack: 87 MiB in all, sha256-checked by pip) into
# .gpuray/wheels, packs them into one tar and splits it into parts of RAY_PART_SIZE (default
# 44m), one folder per device call: .gpuray/r1, .gpuray/r2 (git-ignored through
# .git/info/exclude), each with its PART line (index, count, the tar's and the part's sha256).
# A call carries one folder and the project (~3 MiB): under 48 MiB of the 64 allowed.
# On the GPU machine tools/gpu/ray_env.sh keeps the parts and installs Ray once all are there;
# tools/gpu/ray_local_check.sh does the same here, with stand-ins for the vllm bundle and image.
#
#   bash tools/gpu/prepare_ray.sh
#
# The lock pins the .venv's Ray; for another version, redo it (tools/gpu/ray_lock.py says how).
set -euo pipefail
cd "$(dirname "$0")/../.."
part_size="${RAY_PART_SIZE:-44m}"
lock=tools/gpu/ray-lock.txt
want=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("ray"))')
locked=$(sed -n 's/^ray==\([^ ]*\) .*/\1/p' "$lock")
if [ "$want" != "$locked" ]; then
  echo "$lock pins ray $locked, .venv has $want: redo the lock (tools/gpu/ray_lock.py)" >&2
  exit 1
fi
grep -qxF "/.gpuray/" .git/info/exclude || echo "/.gpuray/" >> .git/info/exclude
mkdir -p .gpuray/wheels
python3 -m pip download -q --no-deps --require-hashes --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
  --platform manylinux1_x86_64 -d .gpuray/wheels -r "$lock"
mapfile -t files < <(sed -n 's/.*# \(.*\.whl\)$/\1/p' "$lock")
rm -rf .gpuray/r[0-9]* .gpuray/ray.tar .gpuray/ray.tar.*
# uncompressed: the wheels are zip archives already; sorted and without owners, so the same
# wheels give the same tar (and the same part checksums) on every run
tar -cf .gpuray/ray.tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 \
  -C .gpuray/wheels "${files[@]}"
sha=$(sha256sum .gpuray/ray.tar | cut -d' ' -f1)
split -b "$part_size" -d -a 2 .gpuray/ray.tar .gpuray/ray.tar.
rm .gpuray/ray.tar
parts=(.gpuray/ray.tar.[0-9][0-9])
for i in "${!parts[@]}"; do
  dir=".gpuray/r$((i + 1))"
  mkdir -p "$dir"
  mv "${parts[$i]}" "$dir/ray.tar.part"
  echo "$((i + 1)) ${#parts[@]} $sha $(sha256sum "$dir/ray.tar.part" | cut -d' ' -f1)" \
    > "$dir/PART"
done
project_kib=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
echo "ray ${locked}: ${#files[@]} wheels, ${#parts[@]} parts (tar sha256 ${sha:0:12}), one call each:"
for dir in .gpuray/r[0-9]*; do
  size=$(stat -c %s "$dir/ray.tar.part")
  printf '  %s: %.1f MiB + the project %.1f MiB\n' "$dir" "$(echo "$size / 1048576" | bc -l)" \
    "$(echo "$project_kib / 1048576" | bc -l)"
done
