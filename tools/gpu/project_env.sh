# Source on the GPU machine, in the project root, after the vllm bundle (tools/gpu/bundle) has
# installed vLLM into /tmp/site (carry .gpuextra/ from prepare_extras.sh in the call):
#
#   source tools/gpu/project_env.sh && python3 -m pytest -m gpu ...
#
# Installs the project into /tmp/projsite (so vLLM's processes see its
# vllm.general_plugins entry points), the extras into /tmp/extrasite (once per
# machine), Prometheus into /tmp/bin, and sets PYTHONPATH and PATH. vLLM's pinned
# packages in /tmp/site come before the extras.
source /tmp/site/env.sh
rm -rf /tmp/projsite
python3 -m pip install -q --no-build-isolation --no-deps --no-index --target /tmp/projsite . \
  || return 1
if [ ! -d /tmp/extrasite ] && [ -d .gpuextra ]; then
  python3 -m pip install -q --no-index --find-links .gpuextra --target /tmp/extrasite \
    pytest pytest-asyncio pytest-timeout hypothesis openai typer rich httpx py-spy uvloop httptools \
    psutil pyyaml aiohttp httpx-aiohttp || return 1
fi
mkdir -p /tmp/bin
if [ ! -x /tmp/bin/prometheus ] && [ -f .gpuextra/prometheus.xz ]; then
  xz -dc .gpuextra/prometheus.xz > /tmp/bin/prometheus && chmod +x /tmp/bin/prometheus
fi
export PYTHONPATH="/tmp/projsite:/tmp/site:/tmp/extrasite"
export PATH="/tmp/bin:/tmp/extrasite/bin:$PATH"
