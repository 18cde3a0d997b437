# The ratelimit-sidecar image: the sidecar (`serve`) and its injector (`webhook`, `inject`).
#   docker build -t ratelimit-sidecar:0.1.0 .
# Two stages: the build stage installs the package, its hot path compiled with mypyc (setup.py),
# and its wheels into a virtualenv; the final stage copies only that virtualenv onto a fresh
# slim Python, with no compiler, no pip and no package lists, and runs as an unprivileged
# numeric user (so runAsNonRoot can verify it).

ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# A C compiler for the compiled build; it stays in this stage.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
RUN python -m venv /opt/ratelimit-sidecar
COPY pyproject.toml setup.py README.md build-requirements.txt ./
COPY sidecar ./sidecar
# Every dependency ships manylinux wheels (grpcio, hiredis); only the package's hot path is
# compiled, by mypyc, which type-checks it against the dependencies and their stubs. So the
# package goes in twice: first as it is, with its dependencies and the build tools (setuptools,
# mypy, the stubs), each pinned in build-requirements.txt so that a new release cannot break or
# change an image built from the same sources; then compiled, built in that environment
# (--no-build-isolation). Then the build tools leave with pip. The tracing extra makes
# `serve --tracing` work in the image, with opentelemetry-proto installed again last:
# xds-protos carries an older copy of its modules.
RUN /opt/ratelimit-sidecar/bin/pip install --upgrade -r build-requirements.txt ".[tracing]" \
 && RATELIMIT_SIDECAR_COMPILE=1 /opt/ratelimit-sidecar/bin/pip install \
        --no-build-isolation --no-deps --force-reinstall . \
 && /opt/ratelimit-sidecar/bin/pip install --no-deps --force-reinstall \
        "opentelemetry-proto==$(/opt/ratelimit-sidecar/bin/python -c 'from importlib.metadata import version; print(version("opentelemetry-proto"))')" \
 && /opt/ratelimit-sidecar/bin/python -P -c "from sidecar import build; import sidecar.rls.fast, sidecar.storage.redis; assert build.name() == 'compiled', build.compiled()" \
 && /opt/ratelimit-sidecar/bin/pip uninstall --yes -r build-requirements.txt pip \
 && find /opt/ratelimit-sidecar -name '__pycache__' -prune -exec rm -rf {} +

FROM python:${PYTHON_VERSION}-slim
LABEL org.opencontainers.image.title="ratelimit-sidecar" \
      org.opencontainers.image.description="Envoy global rate limit service (RLS v3) sidecar" \
      org.opencontainers.image.licenses="Apache-2.0"
# The root filesystem is read-only in the pods: never try to write bytecode.
ENV PATH=/opt/ratelimit-sidecar/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
COPY --from=build /opt/ratelimit-sidecar /opt/ratelimit-sidecar
# The example rules (make run's), which a bare `docker run IMAGE` serves on memory://.
COPY envoy/rules /etc/ratelimit-sidecar/rules
# /bin/ratelimit is where a Deployment written for envoyproxy/ratelimit (Envoy Gateway's
# envoy-ratelimit, Helm charts) runs it: `serve` from the reference's environment variables;
# /bin/ratelimit_config_check beside it checks a rules directory as the reference's does.
RUN python -m compileall -q /opt/ratelimit-sidecar/lib \
 && ln -s /opt/ratelimit-sidecar/bin/ratelimit /bin/ratelimit \
 && ln -s /opt/ratelimit-sidecar/bin/ratelimit_config_check /bin/ratelimit_config_check \
 && groupadd --system --gid 65532 ratelimit \
 && useradd --system --uid 65532 --gid 65532 --no-create-home --shell /usr/sbin/nologin ratelimit
USER 65532:65532
# 8081: gRPC ShouldRateLimit; 8080: /healthcheck, /json, /rlconfig, /metrics; 8443: webhook.
# Run as the reference (`/bin/ratelimit`), it may also open PROMETHEUS_ADDR and DEBUG_PORT.
EXPOSE 8080 8081 8443
# The entrypoint (sidecar/cli/image.py) reads its arguments as either image's user means them:
# none serves (as `ratelimit` when the reference's variables are set, else the example rules),
# `/bin/ratelimit` (compose's `command:` replaces CMD and keeps ENTRYPOINT) is `ratelimit`,
# `ratelimit-sidecar ...` or a command of it (`serve ...`, `check ...`) runs it, `healthcheck`
# asks /healthcheck with the standard library (no curl in the image). CMD is empty: the base
# image's would be `python3`.
ENTRYPOINT ["ratelimit-sidecar-image"]
CMD []
HEALTHCHECK --interval=10s --timeout=6s --start-period=10s --retries=3 \
    CMD ["ratelimit-sidecar-image", "healthcheck"]
