"""An S3-compatible server on loopback that counts, caps and can stall the object bytes it serves.

moto's S3 (``moto.server``) behind a small WSGI layer, served by werkzeug on
127.0.0.1. Run as ``python benchmarks/_capped_s3.py PORT [--mbps 200]``; it
serves until SIGTERM. Object GETs (``/bucket/key``) are counted and, with
``--mbps``, paced so that all connections together stay under that rate.
Control, over HTTP on the same port:

- ``GET /_served``: ``{"bytes": N, "gets": M}`` served since the last reset;
- ``POST /_served``: reset the counters;
- ``POST /_stall?suffix=.distcp``: from now on, GETs of keys ending so get no
  answer (the server stops responding) until ``POST /_stall`` with no suffix.
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
import time
from typing import Any
from urllib.parse import parse_qs

__all__ = ["Capped", "main"]

_PIECE = 64 << 10


class Capped:
    """The WSGI layer: counts object bytes, paces them to ``mbps``, stalls on request."""

    def __init__(self, app: Any, mbps: float | None) -> None:
        self.app = app
        self.rate = None if not mbps else mbps * 1e6
        self.lock = threading.Lock()
        self.served = 0
        self.gets = 0
        self.stall_suffix: str | None = None
        self.unstalled = threading.Event()
        self.unstalled.set()
        self.stopping = threading.Event()
        self._next = time.monotonic()

    def _pace(self, n: int) -> None:
        if self.rate is None:
            return
        with self.lock:
            now = time.monotonic()
            self._next = max(self._next, now) + n / self.rate
            wait = self._next - now
        if wait > 0:
            time.sleep(wait)

    def _control(self, environ: dict[str, Any], start_response: Any) -> list[bytes]:
        path, method = environ["PATH_INFO"], environ["REQUEST_METHOD"]
        if path == "/_served" and method == "POST":
            with self.lock:
                self.served = self.gets = 0
        elif path == "/_stall":
            suffix = parse_qs(environ.get("QUERY_STRING", "")).get("suffix", [None])[0]
            self.stall_suffix = suffix
            (self.unstalled.clear if suffix else self.unstalled.set)()
        with self.lock:
            body = json.dumps({"bytes": self.served, "gets": self.gets}).encode()
        start_response("200 OK", [("Content-Type", "application/json")])
        return [body]

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        path = environ["PATH_INFO"]
        if path.startswith("/_served") or path.startswith("/_stall"):
            return self._control(environ, start_response)
        is_object = environ["REQUEST_METHOD"] == "GET" and path.strip("/").count("/") >= 1
        if not is_object:
            return self.app(environ, start_response)
        suffix = self.stall_suffix
        if suffix and path.endswith(suffix):
            while not (self.unstalled.wait(0.2) or self.stopping.is_set()):
                pass
        with self.lock:
            self.gets += 1
        return self._paced(self.app(environ, start_response))

    def _paced(self, body: Any) -> Any:
        try:
            for chunk in body:
                for at in range(0, len(chunk), _PIECE):
                    piece = chunk[at : at + _PIECE]
                    self._pace(len(piece))
                    with self.lock:
                        self.served += len(piece)
                    yield piece
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("port", type=int)
    parser.add_argument("--mbps", type=float, default=0.0, help="cap in MB/s (0: none)")
    args = parser.parse_args()
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    capped = Capped(DomainDispatcherApplication(create_backend_app), args.mbps)
    server = make_server("127.0.0.1", args.port, capped, threaded=True)

    def stop(*_: Any) -> None:
        capped.stopping.set()
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print("ready", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
