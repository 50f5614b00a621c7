# Set-up is part of every target: a fresh machine needs only `make serve` or `make test`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
LOCK    := requirements/all.lock
PIP     := $(BIN)/python -m pip
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: serve test lint typecheck model bench setup lock clean gpu-check-prep system

setup: $(STAMP)

# Exactly the locked versions, hash-checked, and nothing else (--no-deps: the lock is complete);
# then ctxfuse itself, editable, built with the locked setuptools.
$(STAMP): pyproject.toml constraints.txt $(LOCK)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) install -q --require-hashes --no-deps -c constraints.txt -r $(LOCK)
	$(PIP) install -q --no-deps --no-build-isolation -e .
	$(PIP) check
	touch $(STAMP)

# Regenerate the locks from pyproject.toml's ranges (requirements/README.md): pins already in a lock
# stay unless pyproject.toml rules them out; `make lock UPGRADE=--upgrade` takes the newest of
# everything. The edge and router locks are resolved within the full one, so a device and a router
# run the cloud's versions.
LOCK_TOOL := .venv-lock
UPGRADE   ?=
COMPILE   := $(LOCK_TOOL)/bin/pip-compile --quiet --generate-hashes --allow-unsafe --strip-extras \
	--no-emit-index-url --no-emit-find-links --no-header $(UPGRADE) -c constraints.txt
EDGE_LOCK := requirements/edge.lock
ROUTER_LOCK := requirements/router.lock
lock:
	test -x $(LOCK_TOOL)/bin/pip-compile || ($(PY) -m venv $(LOCK_TOOL) && \
		$(LOCK_TOOL)/bin/pip install -q pip-tools==7.6.2)
	cp $(LOCK) $(LOCK).tmp && cp $(EDGE_LOCK) $(EDGE_LOCK).tmp && cp $(ROUTER_LOCK) $(ROUTER_LOCK).tmp
	$(COMPILE) --extra cloud --extra edge --extra bench --extra test -o $(LOCK).tmp pyproject.toml
	$(PY) requirements/finish_lock.py $(LOCK).tmp ctxfuse && mv $(LOCK).tmp $(LOCK)
	$(COMPILE) --extra edge -c $(LOCK) -o $(EDGE_LOCK).tmp pyproject.toml
	$(PY) requirements/finish_lock.py $(EDGE_LOCK).tmp ctxfuse && mv $(EDGE_LOCK).tmp $(EDGE_LOCK)
	$(COMPILE) --extra router -c $(LOCK) -o $(ROUTER_LOCK).tmp pyproject.toml
	$(PY) requirements/finish_lock.py $(ROUTER_LOCK).tmp ctxfuse && mv $(ROUTER_LOCK).tmp $(ROUTER_LOCK)

model: $(STAMP)
	$(BIN)/ctxfuse models fetch

# What the GPU check carries to a GPU machine without internet (docs/gpu-check.md)
gpu-check-prep: $(STAMP)
	$(BIN)/python -m cloud.bench.gpu_prepare --out .gpu

serve: model
	$(BIN)/ctxfuse serve

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

# Debian packages the tests run for real: a Redis (the replicas' shared state), kubectl (renders
# deploy/'s overlays) and chromium (the console's browser tests); installed where missing (as root,
# or through sudo)
SYSTEM_TOOLS := redis-server kubectl chromium
system:
	@missing=""; for t in $(SYSTEM_TOOLS); do command -v $$t >/dev/null || missing="$$missing $$t"; done; \
	if [ -n "$$missing" ]; then \
		sudo=$$([ "$$(id -u)" -ne 0 ] && command -v sudo >/dev/null && echo sudo); \
		echo "installing$$missing (Debian packages)"; \
		($$sudo apt-get update -qq && $$sudo apt-get install -y -qq $$missing >/dev/null) || \
		{ echo "make test needs$$missing: apt-get install$$missing" >&2; exit 1; }; \
	fi

test: model lint typecheck system
	$(BIN)/python -m pytest -q --durations=30

bench: model
	$(BIN)/ctxfuse bench engine

clean:
	rm -rf $(VENV) $(LOCK_TOOL) .pytest_cache .mypy_cache .ruff_cache
