"""Frequency caps for ad servers, on the counters Envoy's ShouldRateLimit moves.

- `caps.py`: the use case, `FrequencyCaps` (check which ads a user may still see, record
  impressions exactly once).
- `checks.py`: one user's check, its counters named and read once for every candidate ad.
- `json_api.py`: the calls as the HTTP port's JSON (`POST /v1/caps/check`, `/v1/caps/record`).
- `service.py`: the calls as `ratelimit_sidecar.frequency.v1.FrequencyCaps` gRPC messages.
"""
