"""The decision path: a request planned once (`plan.py`: validated, judged by the lists, matched,
its counters named), decided by one backend call (`limiter.py`), refused early when its counters
are known to be over (`over_limit_cache.py`), and counted as the reference counts (`stats.py`).
"""
