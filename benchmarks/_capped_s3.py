"""An S3-compatible server on loopback that counts, caps and can stall the object bytes it serves.

moto's S3 (``moto.server``) behind a small WSGI layer, served by werkzeug on
127.0.0.1. Run as ``python benchmarks/_capped_s3.py PORT [--mbps 200]``; it
serves until SIGTERM. Object GETs (``/bucket/key``) are counted and, with
``--mbps``, paced so that all connections together stay under that rate.
Ranged GETs read only their range of the stored object (as real object stores
do; moto alone reads the whole object for each). Control, over HTTP on the same
port:

- ``GET /_served``: ``{"bytes": N, "gets": M, "checkpoint_bytes": C}`` served since
  the last reset (``checkpoint_bytes``: of keys inside a ``step_<N>`` directory, so
  not the writer's lease);
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

_PIECE = 256 << 10
_BURST_S = 0.05


class Capped:
    """The WSGI layer: counts object bytes, paces them to ``mbps``, stalls on request."""

    def __init__(self, app: Any, mbps: float | None) -> None:
        self.app = app
        self.rate = None if not mbps else mbps * 1e6
        self.lock = threading.Lock()
        self.served = 0
        self.gets = 0
        self.checkpoint_bytes = 0
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
            # A token bucket holding _BURST_S of the rate: a sender that woke late (a busy
            # CPU) catches up, while over any window the bytes stay within the cap.
            self._next = max(self._next, now - _BURST_S) + n / self.rate
            wait = self._next - now
        if wait > 0:
            time.sleep(wait)

    def _control(self, environ: dict[str, Any], start_response: Any) -> list[bytes]:
        path, method = environ["PATH_INFO"], environ["REQUEST_METHOD"]
        if path == "/_served" and method == "POST":
            with self.lock:
                self.served = self.gets = self.checkpoint_bytes = 0
        elif path == "/_stall":
            suffix = parse_qs(environ.get("QUERY_STRING", "")).get("suffix", [None])[0]
            self.stall_suffix = suffix
            (self.unstalled.clear if suffix else self.unstalled.set)()
        with self.lock:
            body = json.dumps(
                {"bytes": self.served, "gets": self.gets, "checkpoint_bytes": self.checkpoint_bytes}
            ).encode()
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
        ranged = self._range(environ, start_response)
        body = ranged if ranged is not None else self.app(environ, start_response)
        return self._paced(body, "/step_" in path)

    def _range(self, environ: dict[str, Any], start_response: Any) -> list[bytes] | None:
        """A plain ``Range: bytes=a-b`` GET of a stored object, read from that range only.

        moto reads the whole object for every ranged GET and slices it (O(object size)
        per request, under the object's lock), which real object stores do not; so
        these are answered here. Anything else (no range, a query, conditions, a
        missing key, a range past the end) goes to moto.
        """
        spec = environ.get("HTTP_RANGE", "")
        if not spec.startswith("bytes=") or "," in spec or environ.get("QUERY_STRING"):
            return None
        if any(
            h in environ for h in ("HTTP_IF_MATCH", "HTTP_IF_NONE_MATCH", "HTTP_IF_MODIFIED_SINCE")
        ):
            return None
        first, _, last = spec[len("bytes=") :].partition("-")
        if not first.isdigit() or not (last.isdigit() or last == ""):
            return None
        from urllib.parse import unquote

        from moto.core import DEFAULT_ACCOUNT_ID
        from moto.s3.models import s3_backends

        bucket, _, name = unquote(environ["PATH_INFO"]).lstrip("/").partition("/")
        try:
            key = s3_backends[DEFAULT_ACCOUNT_ID]["aws"].get_object(bucket, name)
        except Exception:  # noqa: BLE001 - moto answers it (its own error)
            return None
        if key is None or key.size == 0:
            return None
        begin = int(first)
        end = min(int(last) if last else key.size - 1, key.size - 1)
        if begin > end:
            return None
        with key.lock:
            key._value_buffer.seek(begin)
            body = key._value_buffer.read(end - begin + 1)
        start_response(
            "206 Partial Content",
            [
                ("Content-Type", key.metadata.get("Content-Type", "binary/octet-stream")),
                ("Content-Length", str(len(body))),
                ("Content-Range", f"bytes {begin}-{end}/{key.size}"),
                ("Accept-Ranges", "bytes"),
                ("ETag", key.etag),
                ("Last-Modified", key.last_modified_RFC1123),
            ],
        )
        return [body]

    def _paced(self, body: Any, checkpoint: bool) -> Any:
        try:
            for chunk in body:
                for at in range(0, len(chunk), _PIECE):
                    piece = chunk[at : at + _PIECE]
                    self._pace(len(piece))
                    with self.lock:
                        self.served += len(piece)
                        if checkpoint:
                            self.checkpoint_bytes += len(piece)
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
