"""Volumes for the restore tests that count the bytes they serve: S3 on loopback and FUSE.

Both servers run in their own processes (``benchmarks/_capped_s3.py``,
``benchmarks/_counting_fs.py``), so the counts are taken where the bytes leave
the volume, and ranks reach them as users reach theirs: ``s3://`` URLs through
the AWS environment variables, and a mounted directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

_BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))

__all__ = ["s3_server", "s3_served", "s3_stall", "fuse_mount", "fuse_reason", "fuse_served"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _call(endpoint: str, path: str, method: str = "GET") -> dict:
    request = urllib.request.Request(f"{endpoint}{path}", method=method)
    with _DIRECT.open(request, timeout=30) as response:
        return json.loads(response.read())


def s3_served(endpoint: str, reset: bool = False, checkpoints: bool = False) -> int:
    """Object bytes the server sent since the last reset (and reset, with ``reset``);
    with ``checkpoints``, only those of keys inside ``step_<N>`` directories."""
    got = _call(endpoint, "/_served", "POST" if reset else "GET")
    return got["checkpoint_bytes" if checkpoints else "bytes"]


def s3_stall(endpoint: str, suffix: str | None) -> None:
    """Stop answering GETs of keys ending with ``suffix``; None: answer again."""
    _call(endpoint, f"/_stall?suffix={suffix}" if suffix else "/_stall", "POST")


def s3_env(endpoint: str) -> dict[str, str]:
    """The environment that points s3fs (and botocore) at ``endpoint``."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "NO_PROXY": ",".join(filter(None, [os.environ.get("NO_PROXY"), "127.0.0.1"])),
    }


@contextlib.contextmanager
def s3_server(mbps: float = 0.0) -> Iterator[str]:
    """Start the counting S3 server (capped at ``mbps`` MB/s when given); yields its endpoint."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, os.path.join(_BENCH, "_capped_s3.py"), str(port), "--mbps", str(mbps)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the S3 server did not start")
        endpoint = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                s3_served(endpoint)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        yield endpoint
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def fuse_reason() -> str | None:
    """Why a FUSE mount cannot be made here (None: it can)."""
    if os.geteuid() != 0:
        return "needs root"
    if not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:
        return "needs /dev/fuse and fusermount3 (Debian fuse3)"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as exc:
        return f"needs mfusepy and libfuse3: {exc}"
    return None


def fuse_served(control: str) -> int:
    """Bytes the FUSE daemon served so far."""
    try:
        with open(os.path.join(control, "served")) as fh:
            return int(fh.read() or 0)
    except FileNotFoundError:
        return 0


@contextlib.contextmanager
def fuse_mount(source: str, mountpoint: str, control: str) -> Iterator[str]:
    """Serve ``source`` at ``mountpoint`` through the counting FUSE daemon (stall: write a
    suffix to ``control/stall``)."""
    os.makedirs(mountpoint, exist_ok=True)
    os.makedirs(control, exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, os.path.join(_BENCH, "_counting_fs.py"), source, mountpoint, control],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 15
        while not os.path.ismount(mountpoint):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the FUSE daemon could not mount")
            time.sleep(0.05)
        yield mountpoint
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(control, "stall"))
        subprocess.run(["fusermount3", "-u", "-z", mountpoint], check=False, capture_output=True)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
