"""A small HTTP/2 server for unary gRPC, built for one trusted local client (Envoy) and safe
against a hostile one.

`frames` reads and writes frames, `fields` decodes request headers (HPACK) and encodes
response headers, `unary` reads a gRPC request message, `streams` and `connection` are the
protocol state machine (bytes in, bytes out, no I/O), and `server` is the asyncio glue:
sockets, calls as tasks, back-pressure and graceful shutdown.
"""
