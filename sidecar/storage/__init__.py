"""Counter storage behind one interface: memory, Redis and Redis Cluster, chosen by URL."""

from sidecar.storage.base import Backend, open_backend

__all__ = ["Backend", "open_backend"]
