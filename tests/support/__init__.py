"""What the tests share and are not tests: the servers they start (Redis, Envoy, the sidecar,
OTLP receivers, a control plane), the clients and loads they drive, certificates, a clock to
set, and the build under test (`builds`, which conftest.py imports first)."""
