"""What the sidecar reports of its traffic to people: usage per day (`GET /v1/usage`, its query
checked), the limits refusing calls lately and the top keys for Prometheus (`usage.py`), and
the `usage` command (`commands.py`). What is counted, and how, is `sidecar.core.usage`'s;
reading it from Redis is `sidecar.storage.usage_reads`'.
"""
