"""Counter storage behind one interface: memory, Redis, Redis Sentinel and Redis Cluster.

- `base.py`: the `Backend` protocol every store implements; `backends.py` opens one by URL
  (`urls.py` parses the URL, for the injector too).
- `memory.py`: counters in this process.
- `redis.py`, `sentinel.py`, `cluster.py`: the Redis backends, where Redis is called; each
  request is one script call per hash slot, built and read by `scripts.py` (the contract with
  `algorithms/lua/`), through `redis_client.py` (a pipelined RESP client) or
  `cluster_client.py` (the same per master, routed by slot). `failures.py`: what a failed call
  becomes.
- `per_second.py`: per-second counters on a store of their own; `peers.py`: how many sidecars
  share the counters. Counter keys are named in the rules core (`sidecar.core.keys`), a layer
  below.

The package imports only the protocol, so the decision path, which needs it, imports no Redis
client.
"""

from sidecar.storage.base import Applied, Backend

__all__ = ["Applied", "Backend"]
