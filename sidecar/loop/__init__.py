"""How every layer uses the event loop: the callback form of the decision path and its one
adapter to a coroutine (`callbacks.py`), and writes flushed at the end of the read that caused
them (`batching.py`). Imports nothing else of the sidecar, so the storage and the edges share it.
"""
