"""The Rate Limit Quota Service (RLQS): Envoy's `rate_limit_quota` filter enforces quota
assignments itself and reports its usage; this package decides the assignments from the rules.

`allocator` is the pure decision (limit, window, reports, now -> an assignment); `buckets` turns
a bucket id into the rule that limits it; `store` keeps the reported usage and every Envoy's
assignment where all sidecars see them; `service` is the gRPC stream.
"""
