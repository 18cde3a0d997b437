"""What the sidecar tells about itself: Prometheus metrics (`metrics.py`), statsd and DogStatsD
(`statsd.py`), OpenTelemetry spans (`tracing.py`), and its log (`logs.py`).
"""
