"""The Envoy side of the rules: which route `rate_limits` feed a rules file, and a gateway around them.

`sources` reads where each descriptor key comes from in a request, `feeds` decides which
descriptors each route sends (pure, no protobuf), `messages` turns that feed into Envoy's typed
messages (envoy-data-plane) and YAML, `quota` turns it into the rate_limit_quota filter's buckets
instead, and `commands` is the `envoy-config` subcommand.
"""
