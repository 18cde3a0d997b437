"""Throughput benchmark of the rate limit service against a no-op gRPC servicer.

`python -m bench.run` starts each scenario's server, drives it with h2load and prints calls/s,
latency percentiles and server CPU per call; see `bench/run.py`.
"""
