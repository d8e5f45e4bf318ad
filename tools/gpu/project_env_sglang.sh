# Source on the GPU machine, in the project root, after the sglang bundle (tools/gpu/bundle)
# has installed SGLang into /tmp/site-sglang (carry .gpuextra/ from prepare_extras.sh in the
# call): the counterpart of project_env.sh, which is vLLM's.
#
#   source tools/gpu/project_env_sglang.sh && python3 -m pytest ...
#
# Installs the project into /tmp/projsite-sglang (--no-deps: its dependencies come from the
# bundle and the image), the test and CLI extras into /tmp/extrasite-sglang (once per
# machine), Prometheus into /tmp/bin, and sets PYTHONPATH (project, then env.sh's PYTHONPATH,
# then the extras) so that SGLang's pinned packages
# (pydantic, fastapi, uvicorn, openai, transformers, torch) come before the extras' own
# copies of them. No vLLM and no Ray: the service imports neither for engine "sglang".
# Every root can be moved (SGLANG_SITE, PROJSITE, EXTRASITE, BIN_DIR, PYTHON) so that the
# CPU machine can rehearse it on local_check.sh's install of the bundle.
_site=${SGLANG_SITE:-/tmp/site-sglang}
_proj=${PROJSITE:-/tmp/projsite-sglang}
_extra=${EXTRASITE:-/tmp/extrasite-sglang}
_bin=${BIN_DIR:-/tmp/bin}
_py=${PYTHON:-python3}
[ -f "$_site/env.sh" ] || { echo "project_env_sglang.sh: no $_site/env.sh (install the sglang bundle first)" >&2; return 1; }
source "$_site/env.sh"
# the bundle's own PYTHONPATH (env.sh): its site and the CuTe DSL's dsl_packages folder, which the
# nvidia-cutlass-dsl .pth file would add in a site directory (SGLang's Qwen2 MLPs import `cutlass` on CUDA)
_bundle_pp=$PYTHONPATH
rm -rf "$_proj"
# pip without the bundle on PYTHONPATH: it would read the bundle as installed and report its
# pruned requirements as conflicts.
PYTHONPATH= "$_py" -m pip install -q --no-build-isolation --no-deps --no-index --target "$_proj" . \
  || return 1
if [ ! -d "$_extra" ] && [ -d .gpuextra ]; then
  # openai, pydantic and the like come along as requirements; the bundle's copies win below.
  PYTHONPATH= "$_py" -m pip install -q --no-index --find-links .gpuextra --target "$_extra" \
    pytest pytest-asyncio pytest-timeout hypothesis openai typer rich httpx py-spy uvloop httptools \
    psutil pyyaml aiohttp httpx-aiohttp || return 1
fi
mkdir -p "$_bin"
if [ ! -x "$_bin/prometheus" ] && [ -f .gpuextra/prometheus.xz ]; then
  xz -dc .gpuextra/prometheus.xz > "$_bin/prometheus" && chmod +x "$_bin/prometheus"
fi
export PYTHONPATH="$_proj:$_bundle_pp:$_extra"
export PATH="$_bin:$_extra/bin:$PATH"
# SGLang 0.5.23 compiles some kernels of every model at run time (RoPE, SiLU-and-mul:
# sglang.kernels.jit, tvm-ffi + ninja + nvcc + c++; cached in ~/.cache/sglang/jit) and links
# them with -L$CUDA_HOME/lib64 -lcudart, CUDA_HOME defaulting to nvcc's ../.. . An nvcc on
# PATH that is a wrapper (this project's CPU machine: /usr/local/bin/nvcc execs
# /usr/local/cuda-13.0/bin/nvcc) gives /usr/local and a failed link, so CUDA_HOME is set to
# a root with bin/nvcc, include/cuda_runtime.h and lib64/libcudart.so; a root that has only
# libcudart.so.<major> (pip's CUDA wheels) gets a stand-in root of links under /tmp.
_cuda_ok() { [ -x "$1/bin/nvcc" ] && [ -f "$1/include/cuda_runtime.h" ] && [ -e "$1/lib64/libcudart.so" ]; }
if [ -z "${CUDA_HOME:-}" ] || ! _cuda_ok "$CUDA_HOME"; then
  _roots="/usr/local/cuda $(ls -d /usr/local/cuda-* 2>/dev/null)"
  if _w=$(command -v nvcc 2>/dev/null); then
    _roots="$(dirname "$(dirname "$(readlink -f "$_w")")") $(sed -n 's|^exec \(/[^ ]*\)/bin/nvcc.*|\1|p' "$_w" 2>/dev/null) $_roots"
  fi
  _roots="$_roots $(PYTHONPATH= "$_py" -c 'import glob, site
print(" ".join(g for p in site.getsitepackages() for g in sorted(glob.glob(p + "/nvidia/cu*"))))' 2>/dev/null)"
  unset CUDA_HOME
  for _r in $_roots; do _cuda_ok "$_r" && { export CUDA_HOME="$_r"; break; }; done
  if [ -z "${CUDA_HOME:-}" ]; then
    for _r in $_roots; do
      _rt=$(ls "$_r"/lib*/libcudart.so.* 2>/dev/null | head -1)
      [ -x "$_r/bin/nvcc" ] && [ -f "$_r/include/cuda_runtime.h" ] && [ -n "$_rt" ] || continue
      rm -rf /tmp/cuda-home-sglang && mkdir -p /tmp/cuda-home-sglang/lib64
      for _e in "$_r"/*; do [ "$(basename "$_e")" = lib64 ] || ln -s "$_e" /tmp/cuda-home-sglang/; done
      for _e in "$(dirname "$_rt")"/*; do ln -sf "$_e" /tmp/cuda-home-sglang/lib64/; done
      ln -sf "$_rt" /tmp/cuda-home-sglang/lib64/libcudart.so
      export CUDA_HOME=/tmp/cuda-home-sglang
      break
    done
  fi
  unset _w _r _rt _e _roots
fi
[ -n "${CUDA_HOME:-}" ] && export PATH="$CUDA_HOME/bin:$PATH"
echo "project_env_sglang: CUDA_HOME ${CUDA_HOME:-MISSING}, nvcc $(command -v nvcc || echo MISSING), c++ $(command -v c++ || echo MISSING), ninja $(command -v ninja || echo MISSING)"
unset -f _cuda_ok
unset _site _proj _extra _bin _py _bundle_pp
