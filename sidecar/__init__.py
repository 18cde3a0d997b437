"""ratelimit-sidecar: Envoy's global rate limit service (RLS v3), drop-in for envoyproxy/ratelimit."""

__version__ = "0.1.0"
