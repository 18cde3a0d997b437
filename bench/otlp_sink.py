"""An OTLP/HTTP trace receiver that takes every export and keeps nothing: where the tracing
scenario's sidecar sends its spans, so that the bench measures what tracing costs the sidecar.

    python bench/otlp_sink.py --port N
"""

from __future__ import annotations

import argparse
import http.server


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", "0")))
        # An empty ExportTraceServiceResponse: every span accepted.
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    port = parser.parse_args().port
    http.server.ThreadingHTTPServer(("127.0.0.1", port), _Handler).serve_forever()


if __name__ == "__main__":
    main()
