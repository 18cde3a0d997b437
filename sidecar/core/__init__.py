"""The rules core: what a request's descriptors match and which counters they name. Pure: no
clock, no I/O but `config.load` and `lists.read` reading their files.

- `rules.py`: the rule tree (Domain, Level, Node, Rules) a rules file becomes; `config.py`: the
  YAML format parsed into it; `matching.py`: (domain, descriptor entries) -> rule.
- `lists.py`: allow and deny lists, which decide a request before any counter is asked.
- `counters.py`: each window's Hit, under the counter's key or as a field of its descriptor's
  hash; `keys.py`: the hash-tagged descriptor part of every key.
- `usage.py`: the rules' `usage` dimensions and the hits that count a request per day.

Below the storage, which counts those hits, and above `sidecar.algorithms` (when a window starts
and ends); it imports neither grpc, protobuf nor redis.
"""
