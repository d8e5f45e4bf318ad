#!/usr/bin/env bash
# prepare.sh BUNDLE -- run on the CPU machine, anywhere in the project:  bash tools/gpu/bundle/prepare.sh sglang
#
# BUNDLE is a folder beside this script (vllm, sglang) holding bundle.env, lock-<piece>.txt (one
# pip requirement + PyPI sha256 + wheel file name a line), slim.txt and smoke.py. This script
# 1. downloads the locked wheels (exact files, sha256-checked) into the wheel cache,
#    $GPU_BUNDLE_CACHE/wheels (default: .cache-gpu-bundles beside the checkout, shared by worktrees
#    and bundles); nothing is downloaded when every locked wheel is there;
# 2. slims the wheels bundle.env's SLIM names (slim_wheel.py with the bundle's slim.txt) and packs
#    one tar per piece; splits them into $PART_SIZE parts (default: bundle.env's DEFAULT_PART_SIZE,
#    else 59m) and writes manifest.txt;
# 3. stages one git-ignored folder per GPU call, .gpu-BUNDLE/<id>, holding its part, manifest.txt,
#    device_step.sh, check_reqs.py, bundle.env, smoke.py (and pruned.txt); adds /.gpu-BUNDLE/ to
#    .git/info/exclude;
# 4. prints the calls to make.  Re-running skips what is done (PART_SIZE changes rebuild the parts).
# Needs: git, python3 -m pip (any Python: the wheels are chosen for CPython 3.12), GNU tar/split.
set -euo pipefail
export LC_ALL=C
HERE=$(cd "$(dirname "$0")" && pwd)
NAME=${1:?usage: prepare.sh BUNDLE   (one of: $(cd "$HERE" && ls -d */ | tr -d / | tr '\n' ' '))}
BDIR=$HERE/$NAME
[ -f "$BDIR/bundle.env" ] || { echo "prepare.sh: no bundle $BDIR/bundle.env" >&2; exit 1; }
# shellcheck source=/dev/null
source "$BDIR/bundle.env"   # TITLE PIECES SLIM STORE SITE ENVV
PROJ=$(git rev-parse --show-toplevel)
OUT=$PROJ/.gpu-$NAME
BUILD=$OUT/build
CACHE=${GPU_BUNDLE_CACHE:-$(dirname "$PROJ")/.cache-gpu-bundles}
WHEELS=$CACHE/wheels
PART_SIZE=${PART_SIZE:-${DEFAULT_PART_SIZE:-59m}}
LOCKS=$(for p in $PIECES; do echo "$BDIR/lock-${p%%:*}.txt"; done)
# what the parts come from: a change in any of these rebuilds them
SRC=$(cat $LOCKS "$BDIR/slim.txt" "$HERE/slim_wheel.py" | sha256sum | cut -c1-16)
mkdir -p "$OUT" "$BUILD" "$WHEELS"

EXC=$(git -C "$PROJ" rev-parse --git-path info/exclude)
case "$EXC" in /*) ;; *) EXC=$PROJ/$EXC ;; esac
mkdir -p "$(dirname "$EXC")"
if ! grep -qxF "/.gpu-$NAME/" "$EXC" 2>/dev/null; then
  [ ! -s "$EXC" ] || [ -z "$(tail -c1 "$EXC")" ] || echo >> "$EXC"
  echo "/.gpu-$NAME/" >> "$EXC"
fi

# "sha256  file" for every wheel of the given lock files
locked() { sed -n 's/^[^#].*--hash=sha256:\([0-9a-f]*\).*# *\([^ ]*\.whl\)$/\1  \2/p' "$@"; }
# true when every part named in manifest.txt is staged, intact, for these sources and PART_SIZE
staged() {
  [ -f "$OUT/manifest.txt" ] && grep -qxF "SOURCE $SRC SPLIT $PART_SIZE" "$OUT/manifest.txt" &&
  awk '$1=="PART"{print $4"  "$2"/"$2".part"}' "$OUT/manifest.txt" | (cd "$OUT" && sha256sum --quiet -c - >/dev/null 2>&1)
}

if staged; then
  echo "== parts already staged and intact (.gpu-$NAME/manifest.txt)"
else
  # ---- 1. wheels ----
  # shellcheck disable=SC2086
  if ! locked $LOCKS | (cd "$WHEELS" && sha256sum --quiet -c - >/dev/null 2>&1); then
    echo "== downloading the locked wheels into $WHEELS"
    PLAT="--python-version 3.12 --implementation cp --only-binary=:all:"
    for n in $(seq 5 39); do PLAT="$PLAT --platform manylinux_2_${n}_x86_64"; done
    PLAT="$PLAT --platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64"
    # shellcheck disable=SC2086
    python3 -m pip download -q --no-deps --require-hashes $PLAT -d "$WHEELS" \
      $(printf -- '-r %s ' $LOCKS) 2>&1 | grep -v 'is ignored' || true
    # shellcheck disable=SC2086
    locked $LOCKS | (cd "$WHEELS" && sha256sum --quiet -c -) \
      || { echo "prepare.sh: the wheels above are missing or differ from the lock files" >&2; exit 1; }
  fi
  # shellcheck disable=SC2086
  echo "== $(locked $LOCKS | wc -l) locked wheels present in $WHEELS"

  # ---- 2. stage the wheels (hard links), slim, pack, split ----
  STAGE=$BUILD/stage
  rm -rf "$STAGE" "$BUILD/split" && mkdir -p "$BUILD/split"
  SLIMKEY=$(cat "$BDIR/slim.txt" "$HERE/slim_wheel.py" | sha256sum | cut -c1-16)   # slimmed wheels stay valid
  [ -f "$BUILD/slim/.by-$SLIMKEY" ] || { rm -rf "$BUILD/slim"; mkdir -p "$BUILD/slim"; touch "$BUILD/slim/.by-$SLIMKEY"; }
  for p in $PIECES; do
    b=${p%%:*}
    mkdir -p "$STAGE/$b"
    for f in $(locked "$BDIR/lock-$b.txt" | awk '{print $2}'); do
      ln "$WHEELS/$f" "$STAGE/$b/$f" 2>/dev/null || cp "$WHEELS/$f" "$STAGE/$b/$f"
    done
    # shellcheck disable=SC2086
    for f in $(cd "$STAGE/$b" && ls $SLIM 2>/dev/null); do
      [ -f "$BUILD/slim/$f" ] || python3 "$HERE/slim_wheel.py" "$BDIR/slim.txt" "$WHEELS/$f" "$BUILD/slim/$f"
      rm "$STAGE/$b/$f" && ln "$BUILD/slim/$f" "$STAGE/$b/$f"
    done
    (cd "$STAGE/$b" && tar --format=gnu --sort=name --owner=0 --group=0 --numeric-owner --mode=0644 \
        --mtime=@0 -cf - ./*.whl) | split -b "$PART_SIZE" -d -a 3 - "$BUILD/split/$b."
  done

  # ---- 3. manifest and one folder per part ----
  for id in $(awk '$1=="PART"{print $2}' "$OUT/manifest.txt" 2>/dev/null); do rm -rf "${OUT:?}/$id"; done
  rm -f "$OUT/manifest.txt"
  M=$BUILD/manifest.txt
  {
    echo "# gpu bundle $NAME (tools/gpu/bundle/prepare.sh): $TITLE; read by device_step.sh"
    echo "SOURCE $SRC SPLIT $PART_SIZE"
    for p in $PIECES; do
      b=${p%%:*}
      echo "BUNDLE $b $(cat "$BUILD/split/$b".* | sha256sum | cut -d' ' -f1) $(cat "$BUILD/split/$b".* | wc -c)"
    done
    for p in $PIECES; do
      b=${p%%:*}; fmt=$(cut -d: -f2 <<<"$p"); k=0
      for s in "$BUILD/split/$b".*; do
        k=$((k + 1)); id=$(printf "$fmt" $k)   # piece main: p01 p02 ..., nccl: n1 n2 ...
        echo "PART $id $b $(sha256sum "$s" | cut -d' ' -f1) $(stat -c %s "$s")"
        mkdir -p "$OUT/$id" && mv "$s" "$OUT/$id/$id.part"
      done
    done
    for p in $PIECES; do
      b=${p%%:*}
      for w in "$STAGE/$b"/*.whl; do echo "WHEEL $b $(sha256sum "$w" | cut -d' ' -f1) $(basename "$w")"; done
    done
  } > "$M"
  for d in $(awk '$1=="PART"{print $2}' "$M"); do cp "$M" "$OUT/$d/manifest.txt"; done
  rm -rf "$STAGE" "$BUILD/split"
  mv "$M" "$OUT/manifest.txt"
  echo "== staged $(grep -c '^PART ' "$OUT/manifest.txt") folders in $OUT"
fi

IDS=$(awk '$1=="PART"{print $2}' "$OUT/manifest.txt")
for d in $IDS; do   # always the current scripts
  cp "$HERE/device_step.sh" "$HERE/check_reqs.py" "$BDIR/bundle.env" "$BDIR/smoke.py" "$OUT/$d/"
  [ ! -f "$BDIR/pruned.txt" ] || cp "$BDIR/pruned.txt" "$OUT/$d/"
done
if [ -f "$BDIR/tested-parts.sha256" ] && [ "$PART_SIZE" = "$(sed -n 's/^# PART_SIZE=\([^ ]*\).*/\1/p' "$BDIR/tested-parts.sha256")" ]; then
  if (cd "$OUT" && sha256sum --quiet -c "$BDIR/tested-parts.sha256" >/dev/null 2>&1); then
    echo "== all parts are byte-identical to the tested build ($NAME/tested-parts.sha256)"
  else
    echo "NOTE: parts differ from $NAME/tested-parts.sha256 (another zlib/Python re-deflates the slimmed" \
         "wheels differently?); they are still self-consistent (manifest.txt)."
  fi
fi

# ---- 4. size check and the calls ----
TRAV=$( (cd "$PROJ" && git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s 2>/dev/null) \
        | awk '{s += $1} END {print s + 0}') || true
BIG=$(for d in $IDS; do du -sb "$OUT/$d" | cut -f1; done | sort -n | tail -1)
echo "== $(wc -w <<<"$IDS") parts," \
     "$(awk '$1=="BUNDLE"{s += $4} END {printf "%.0f", s / 1048576}' "$OUT/manifest.txt") MiB;" \
     "each call carries <= $(( (TRAV + BIG) / 1024 )) KiB of 65536 KiB" \
     "(project files $(( TRAV / 1024 )) KiB + largest folder $(( BIG / 1024 )) KiB)"
if [ $((TRAV + BIG)) -gt $((63 * 1024 * 1024)) ]; then
  echo "WARNING: that leaves under 1 MiB of headroom (the project's files travel with every call);" \
       "re-run with smaller parts: PART_SIZE=$(( (63 * 1024 * 1024 - TRAV - 100 * 1024) / 1024 / 1024 ))m bash $0 $NAME" >&2
fi
echo "== make these $(wc -w <<<"$IDS") calls back to back (a pause over 30 s loses the machine and its /tmp);"
echo "   any order works: the call that completes the set installs and prints SMOKE OK"
# add-on pieces first, the main piece last (its last call then installs everything)
for p in $PIECES; do [ "${p%%:*}" = main ] || awk -v b="${p%%:*}" '$1=="PART" && $3==b {print $2}' "$OUT/manifest.txt"; done > "$BUILD/order"
awk '$1=="PART" && $3=="main" {print $2}' "$OUT/manifest.txt" >> "$BUILD/order"
while read -r d; do
  echo "run(carry=[\".gpu-$NAME/$d\"], command=\"bash .gpu-$NAME/$d/device_step.sh\", timeout_s=300)"
done < "$BUILD/order"
echo "== then, on the warm machine: source $SITE/env.sh && python3 ..."
