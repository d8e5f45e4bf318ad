#!/usr/bin/env bash
# device_step.sh -- runs ON THE GPU MACHINE, once per carried folder, in any order:
#     bash .gpu-<bundle>/<id>/device_step.sh        (<id>: p01.. main piece, n1.. add-on pieces)
# The folder holds one part, manifest.txt, bundle.env (the bundle's pieces, install targets and
# environment line), smoke.py and this script, all staged by prepare.sh.
# Checks this folder's part against manifest.txt, keeps it in $STORE/parts and prints which parts
# the machine still lacks.  The call that completes a piece reassembles it, checks every sha256 and
# runs  pip install --no-index --no-deps --target <the piece's target>.  When every piece is
# installed (whichever came last) it links $SITE/nvidia/* (the add-on pieces' first, e.g. a newer
# NCCL, then the image's CUDA libraries), writes $SITE/env.sh, reports Requires-Dist that the
# bundle + image leave unmet (check_reqs.py; informational) and runs the bundle's smoke.py.
# Exit: 0 ok (part kept / installed / SMOKE OK), 2 bad part or manifest, 3 install or smoke test
# failed, 4 the image's python3 is not 3.12.  /tmp lives only while the machine stays warm.
# GPU_BUNDLE_SKIP_SMOKE=1 on the last call skips the smoke test (about 95 s of device time for the
# sglang bundle) when the same build (manifest) already passed it earlier that session: a
# re-install on a fresh machine, not a new build.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
MAN=$HERE/manifest.txt
[ -f "$MAN" ] && [ -f "$HERE/bundle.env" ] || { echo "no manifest.txt or bundle.env in $HERE" >&2; exit 2; }
# shellcheck source=/dev/null
source "$HERE/bundle.env"   # NAME PIECES STORE SITE ENVV SMOKE_ENV
ROOT=${GPU_BUNDLE_STORE:-$STORE}
PY=${PYTHON:-python3}
if [ -n "${GPU_BUNDLE_PREFIX:-}" ]; then   # local_check.sh: install under a temporary folder instead
  PIECES=$(for p in $PIECES; do printf '%s:%s ' "${p%:*}" "$GPU_BUNDLE_PREFIX${p##*:}"; done)
  ENVV=${ENVV//$SITE/$GPU_BUNDLE_PREFIX$SITE}; SITE=$GPU_BUNDLE_PREFIX$SITE
fi

# first call on this machine (or parts of a new build): check the image's python, empty store
if ! cmp -s "$MAN" "$ROOT/manifest.txt"; then
  V=$("$PY" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')
  case "$V" in 3.12.*) ;; *) echo "image python3 is $V; these wheels are for 3.12" >&2; exit 4 ;; esac
  [ -f "$ROOT/manifest.txt" ] && echo "parts of another build in $ROOT: starting over"
  rm -rf "$ROOT" && mkdir -p "$ROOT/parts" && cp "$MAN" "$ROOT/manifest.txt"
fi

# keep the carried part
for f in "$HERE"/*.part; do
  [ -e "$f" ] || continue
  id=$(basename "$f" .part)
  want=$(awk -v i="$id" '$1=="PART" && $2==i {print $4}' "$MAN")
  got=$(sha256sum "$f" | cut -d' ' -f1)
  [ -n "$want" ] && [ "$got" = "$want" ] || { echo "$id: sha256 $got != manifest ${want:-(none)}" >&2; exit 2; }
  cp "$f" "$ROOT/parts/$id.tmp" && mv "$ROOT/parts/$id.tmp" "$ROOT/parts/$id.part"
done
cp "$HERE/smoke.py" "$HERE/check_reqs.py" "$ROOT/"
[ ! -f "$HERE/pruned.txt" ] || cp "$HERE/pruned.txt" "$ROOT/"
ALL=$(awk '$1=="PART"{print $2}' "$MAN")
MISS=$(for i in $ALL; do [ -f "$ROOT/parts/$i.part" ] || printf '%s ' "$i"; done)
echo "gpu-$NAME: $(( $(wc -w <<<"$ALL") - $(wc -w <<<"$MISS") ))/$(wc -w <<<"$ALL") parts on this machine; missing: ${MISS:-none}"

bundle_sha() { awk -v b="$1" '$1=="BUNDLE" && $2==b {print $3}' "$MAN"; }
installed() { [ -f "$2/.bundle" ] && [ "$(cat "$2/.bundle")" = "$(bundle_sha "$1")" ]; }

install() {  # piece target: install it once all its parts are here
  local b=$1 t=$2 ids i d=$ROOT/$1 t0
  installed "$b" "$t" && return 0
  ids=$(awk -v b="$b" '$1=="PART" && $3==b {print $2}' "$MAN")
  for i in $ids; do [ -f "$ROOT/parts/$i.part" ] || return 0; done
  t0=$(date +%s)
  rm -rf "$d" && mkdir -p "$d/files"
  for i in $ids; do cat "$ROOT/parts/$i.part"; done > "$d/bundle.tar"
  [ "$(sha256sum "$d/bundle.tar" | cut -d' ' -f1)" = "$(bundle_sha "$b")" ] \
    || { echo "$b: piece sha256 differs from the manifest" >&2; return 2; }
  tar -xf "$d/bundle.tar" -C "$d/files" && rm -f "$d/bundle.tar" || { echo "$b: tar failed" >&2; return 2; }
  (cd "$d/files" && awk -v b="$b" '$1=="WHEEL" && $2==b {print $3"  "$4}' "$MAN" | sha256sum --quiet -c -) \
    || { echo "$b: wheel sha256 mismatch" >&2; return 2; }
  rm -rf "$t"
  if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
      --target "$t" "$d"/files/*.whl > "$d/pip.log" 2>&1; then
    tail -n 5 "$d/pip.log"; echo "$b: pip install failed (log: $d/pip.log)" >&2; return 3
  fi
  bundle_sha "$b" > "$t/.bundle"
  echo "$b: $(ls "$d"/files/*.whl | wc -l) wheels verified and installed in $t in $(( $(date +%s) - t0 )) s"
  # a wheel's .pth file (extra sys.path entries) is read only in site directories, never from a
  # --target folder on PYTHONPATH: bundle.env's ENVV has to name what each one adds
  ls "$t"/*.pth >/dev/null 2>&1 && echo "$b: .pth files, not read from PYTHONPATH (bundle.env's ENVV adds their paths by hand):" \
    "$(cd "$t" && ls *.pth | tr '\n' ' ')"
  rm -rf "$d/files"
}
done_all=1
for p in $PIECES; do   # "piece:id-format:target"
  b=${p%%:*}; t=${p##*:}
  install "$b" "$t" || exit $?
  installed "$b" "$t" || done_all=0
done
if [ $done_all = 0 ]; then
  echo "send the missing parts next, back to back (this machine's /tmp is lost 30 s after a call)"
  exit 0
fi

# link $SITE/nvidia/* so torch's RPATH ($ORIGIN/../../nvidia/{cu13,cudnn,nccl,...}/lib) finds the
# CUDA libraries: the add-on pieces' first (a newer NCCL), then the image's own site-packages
DEV_SP=$(env -u PYTHONPATH "$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf "$SITE/nvidia" && mkdir -p "$SITE/nvidia"
for p in $PIECES; do
  t=${p##*:}; [ "$t" = "$SITE" ] && continue
  for d in "$t"/nvidia/*/; do
    [ -d "$d" ] || continue; n=$(basename "$d"); [ -e "$SITE/nvidia/$n" ] || ln -s "${d%/}" "$SITE/nvidia/$n"
  done
done
for d in "$DEV_SP"/nvidia/*/; do
  [ -d "$d" ] || continue; n=$(basename "$d"); [ -e "$SITE/nvidia/$n" ] || ln -s "${d%/}" "$SITE/nvidia/$n"
done
echo "export $ENVV" > "$SITE/env.sh"
cp "$ROOT/smoke.py" "$SITE/_smoke.py"

# the bundle's wheels ask for packages the image may hold in other versions: list what is unmet
# shellcheck disable=SC2086
env $ENVV "$PY" "$ROOT/check_reqs.py" installed "$ROOT/pruned.txt" $(for p in $PIECES; do printf '%s ' "${p##*:}"; done) \
  2>&1 | tail -n 40

if [ "${GPU_BUNDLE_SKIP_SMOKE:-0}" = 1 ]; then
  echo "SMOKE skipped (GPU_BUNDLE_SKIP_SMOKE=1) -- later calls: source $SITE/env.sh"; exit 0
fi
# shellcheck disable=SC2086
if ! OUT=$(env $ENVV $SMOKE_ENV "$PY" "$SITE/_smoke.py" 2>&1); then
  echo "$OUT" > "$ROOT/smoke.log"; tail -n 12 <<<"$OUT"; echo "smoke test failed (log: $ROOT/smoke.log)" >&2; exit 3
fi
echo "$OUT" > "$ROOT/smoke.log"
grep -E '^(SMOKE|  )' <<<"$OUT" | tail -n 30
echo "SMOKE OK -- later calls: source $SITE/env.sh   (= export $ENVV)"
