# Source on the GPU machine, in the project root: Ray for Ray Serve (batch.sh rayserve,
# rayserve-load), carried in the parts tools/gpu/prepare_ray.sh made (.gpuray/r1, r2). After the
# vllm bundle (tools/gpu/bundle), one call per part, then the steps (carry .gpuextra):
#
#   source tools/gpu/project_env.sh && source tools/gpu/ray_env.sh       # carry .gpuray/r1
#   source tools/gpu/project_env.sh && source tools/gpu/ray_env.sh       # carry .gpuray/r2
#   source tools/gpu/project_env.sh && source tools/gpu/ray_env.sh && bash tools/gpu/batch.sh rayserve
#
# Every call keeps the parts it carries in $RAY_STORE (/tmp/gpu-ray; /tmp lives as long as the
# machine is held, so the calls go back to back). The call that completes the set checks the
# tar's sha256 and installs its wheels with pip --no-index --no-deps --target $RAY_SITE
# (/tmp/raysite): no resolution, the lock (tools/gpu/ray-lock.txt) carries only what the vllm
# bundle, the image and .gpuextra lack. Once Ray is installed, every call appends $RAY_SITE to
# PYTHONPATH, after project_env.sh's /tmp/site (vLLM's pins) and /tmp/extrasite, so no package
# of Ray's set shadows one vLLM pinned; and the first such call runs tools/gpu/ray_check.py
# --smoke (unmet requirements, imports, a one-deployment Serve app; ~20 s) with that path.
# Returns 1 on a damaged part, a failed install or a failed check (logs in $RAY_STORE).
ray_store="${RAY_STORE:-/tmp/gpu-ray}"
ray_site="${RAY_SITE:-/tmp/raysite}"
mkdir -p "$ray_store"
for ray_part in .gpuray/r*/PART; do  # (a folder carried once may stay for later calls)
  [ -f "$ray_part" ] && [ ! -f "$ray_site/.installed" ] || continue
  read -r ray_i ray_n ray_sha ray_part_sha < "$ray_part"
  if [ "$(sha256sum "${ray_part%PART}ray.tar.part" | cut -d' ' -f1)" != "$ray_part_sha" ]; then
    echo "ray: part $ray_i of $ray_n is damaged (${ray_part%/PART})" >&2
    return 1
  fi
  cp "${ray_part%PART}ray.tar.part" "$ray_store/$ray_sha.$ray_i"
  echo "$ray_n $ray_sha" > "$ray_store/set"
  echo "ray: kept part $ray_i of $ray_n"
done
if [ ! -f "$ray_site/.installed" ] && [ -f "$ray_store/set" ]; then
  read -r ray_n ray_sha < "$ray_store/set"
  ray_missing=""
  for ray_i in $(seq 1 "$ray_n"); do
    [ -f "$ray_store/$ray_sha.$ray_i" ] || ray_missing="$ray_missing .gpuray/r$ray_i"
  done
  if [ -n "$ray_missing" ]; then
    echo "ray: parts still to carry:$ray_missing"
  else
    for ray_i in $(seq 1 "$ray_n"); do cat "$ray_store/$ray_sha.$ray_i"; done \
      > "$ray_store/ray.tar"
    if [ "$(sha256sum "$ray_store/ray.tar" | cut -d' ' -f1)" != "$ray_sha" ]; then
      echo "ray: the joined parts do not match their sha256" >&2
      rm -f "$ray_store/ray.tar"
      return 1
    fi
    rm -rf "$ray_store/wheels" "$ray_site" && mkdir -p "$ray_store/wheels"
    tar -xf "$ray_store/ray.tar" -C "$ray_store/wheels" && rm -f "$ray_store/ray.tar"
    echo "ray: installing $(ls "$ray_store/wheels" | wc -l) wheels into $ray_site"
    if ! python3 -m pip install --no-index --no-deps --no-compile --target "$ray_site" \
        "$ray_store"/wheels/*.whl > "$ray_store/install.log" 2>&1; then
      tail -20 "$ray_store/install.log" >&2
      return 1
    fi
    touch "$ray_site/.installed"
    rm -rf "$ray_store/wheels" "$ray_store/$ray_sha".*
  fi
fi
if [ -f "$ray_site/.installed" ]; then
  case ":${PYTHONPATH:-}:" in
    *":$ray_site:"*) ;;
    *) export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$ray_site" ;;
  esac
  export PATH="$PATH:$ray_site/bin"
  export RAY_USAGE_STATS_ENABLED=0  # no registry or stats server is reachable from here
  if [ ! -f "$ray_store/checked" ]; then
    if python3 tools/gpu/ray_check.py --smoke > "$ray_store/check.log" 2>&1; then
      touch "$ray_store/checked"
      grep -E "^(python |ray|  |imports ok|serve smoke)" "$ray_store/check.log"  # not Ray's logs
    else
      tail -40 "$ray_store/check.log" >&2
      return 1
    fi
  fi
else
  echo "ray: not installed yet; PYTHONPATH unchanged"
fi
