# The two commands a newcomer needs: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# apt-get needs root; use sudo when we are not root and it exists.
SUDO := $(shell [ "$$(id -u)" = 0 ] || command -v sudo)
PYTEST_ARGS ?=

.PHONY: venv run test test-deps bench bench-deps lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,dev]'
	touch $(STAMP)

venv: $(STAMP)

## Serve the example rules on the in-memory backend (gRPC :8081, HTTP :8080).
run: venv
	$(BIN)/ratelimit-sidecar serve --config envoy/rules --log-format console

## Install what the tests need (redis-server), then run the whole suite.
test: venv test-deps
	$(BIN)/pytest $(PYTEST_ARGS)

test-deps:
	@if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then \
		echo "installing redis-server (apt-get)"; \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq redis-server >/dev/null; \
	fi
	@# The apt package starts a system redis on :6379; the tests start their own on free ports.

## Benchmarks (not tests): calls/s, latency and CPU per call, side by side.
bench: venv bench-deps
	$(BIN)/python -m bench.run

bench-deps: test-deps
	@if ! command -v h2load >/dev/null; then \
		echo "installing h2load (apt-get nghttp2-client)"; \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq nghttp2-client >/dev/null; \
	fi

lint: venv
	$(BIN)/ruff check sidecar tests bench
	$(BIN)/mypy

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .mypy_cache .ruff_cache
