# minserve: two commands on a fresh machine.
#   make demo   installs into .venv and runs the tour on the embedded model
#   make test   installs into .venv and runs the whole test suite (what CI runs)

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU wheel of torch; installing it first keeps pip from pulling a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: demo test install lint test-unit lab models clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[all]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/minserve demo

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

test-unit: install
	$(BIN)/pytest -q

test: lint test-unit

lab: install
	$(BIN)/jupyter lab chapters/

# Retrain both embedded models from scratch on this machine's Python standard library (~40 min on 2 cores).
models: install
	$(BIN)/python scripts/train_tiny_models.py --out minserve/assets
	$(BIN)/python scripts/models_report.py

clean:
	rm -rf $(VENV) site .pytest_cache
