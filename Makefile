# Set-up is part of every target: a fresh machine needs only `make serve` or `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: serve test lint typecheck model bench setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

model: $(STAMP)
	$(BIN)/ctxfuse models fetch

serve: model
	$(BIN)/ctxfuse serve

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

test: model lint typecheck
	$(BIN)/python -m pytest -q

bench: model
	$(BIN)/ctxfuse bench engine

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
