"""``python -m nbtools doctor``: this machine passes; each broken condition is caught.

Broken conditions are real ones: a tmpfs of 16 MiB mounted as the shared-memory filesystem,
a cache directory on a read-only bind mount (root) or without write permission (other
users), a ``RAY_ADDRESS`` whose port nothing listens on. The checks are run in-process where
that is enough, and through the command line for the exit status and the JSON output.
"""

from __future__ import annotations

import contextlib
import http.server
import importlib.metadata
import importlib.util
import json
import os
import platform
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import nbtools
from nbtools._doctor import Status, _launch, _machine, _storage
from nbtools._doctor._report import exit_status


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once it is closed


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def _read_only(path: Path) -> Iterator[None]:
    """``path`` made read-only: a read-only bind mount as root, mode 0555 otherwise."""
    if os.geteuid() == 0:
        try:
            _mount("--bind", str(path), str(path))
        except (OSError, subprocess.CalledProcessError) as exc:
            pytest.skip(f"cannot bind-mount here: {exc}")
        try:
            _mount("-o", "remount,bind,ro", str(path))
            yield
        finally:
            subprocess.run(["umount", str(path)], check=True, timeout=30)
    else:
        path.chmod(0o555)
        try:
            yield
        finally:
            path.chmod(0o755)


@pytest.fixture
def tiny_shm(tmp_path) -> Iterator[Path]:
    """A 16 MiB tmpfs, standing in for a container's small /dev/shm (needs root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "shm"
    mount.mkdir()
    try:
        _mount("-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount))
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True, timeout=30)


def test_a_small_shm_is_a_warning_that_says_how_to_enlarge_it(tiny_shm):
    finding = _machine.check_shm(str(tiny_shm))
    assert finding.status is Status.WARN, finding
    assert str(tiny_shm) in finding.summary and "16 MiB" in finding.summary
    assert "--shm-size" in finding.advice
    assert exit_status([finding]) == 0  # a warning never stops training


def test_the_real_shm_is_measured():
    finding = _machine.check_shm("/dev/shm")
    assert finding.details["total"] > 0 and finding.status in (Status.OK, Status.WARN)


def test_the_shared_memory_checked_is_where_the_memory_tier_keeps_its_snapshots(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("NBTOOLS_SNAPSHOT_DIR", str(tmp_path))
    assert _machine.check_shm().details["path"] == str(tmp_path)
    monkeypatch.delenv("NBTOOLS_SNAPSHOT_DIR")
    assert _machine.check_shm().details["path"] == "/dev/shm"


def test_the_nbtools_variables_set_are_checked_against_the_settings_table():
    fine = _machine.check_settings({"NBTOOLS_STAGING_DIR": "/scratch", "HOME": "/root"})
    assert fine.status is Status.OK and "NBTOOLS_STAGING_DIR" in fine.summary, fine
    assert _machine.check_settings({}).status is Status.OK
    # Set by nbtools in its ranks: never the user's to fix.
    assert _machine.check_settings({"NBTOOLS_NODE_ID": "first"}).status is Status.OK
    misspelt = _machine.check_settings({"NBTOOLS_SHM_DIR": "/big"})
    assert misspelt.status is Status.WARN, misspelt
    assert "NBTOOLS_SHM_DIR is set but nbtools reads no such variable" in misspelt.summary
    refused = _machine.check_settings(
        {"NBTOOLS_STRAGGLER_THRESHOLD": "1.5", "NBTOOLS_LOG_LEVEL": "info"}
    )
    assert refused.status is Status.FAIL and refused.advice, refused
    assert refused.summary.startswith("NBTOOLS_STRAGGLER_THRESHOLD='1.5' is not a valid")
    assert "must be between 0 and 1" in refused.summary
    assert exit_status([refused]) == 1


def test_a_read_only_cache_dir_fails_naming_it(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("NBTOOLS_CACHE_DIR", str(cache))
    with _read_only(cache):
        finding = _storage.check_cache()
    assert finding.status is Status.FAIL, finding
    assert str(cache) in finding.summary and "NBTOOLS_CACHE_DIR" in finding.advice
    assert exit_status([finding]) == 1


def test_a_cache_dir_not_made_yet_is_checked_through_its_parent_and_not_created(
    tmp_path, monkeypatch
):
    cache = tmp_path / "not" / "yet"
    monkeypatch.setenv("NBTOOLS_CACHE_DIR", str(cache))
    finding = _storage.check_cache()
    assert finding.status in (Status.OK, Status.WARN), finding
    assert not (tmp_path / "not").exists()
    assert list(tmp_path.iterdir()) == []  # the probe file is gone


def test_a_read_only_staging_dir_fails(tmp_path, monkeypatch):
    staging = tmp_path / "staging"
    staging.mkdir()
    monkeypatch.setenv("NBTOOLS_STAGING_DIR", str(staging))
    with _read_only(staging):
        finding = _storage.check_staging()
    assert finding.status is Status.FAIL and "NBTOOLS_STAGING_DIR" in finding.advice, finding


def test_an_unreachable_ray_address_fails_at_once(monkeypatch):
    if importlib.util.find_spec("ray") is None:  # not imported: importing ray sets variables
        pytest.skip("ray is not installed")
    port = _closed_port()
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    finding = _launch.check_ray()
    assert finding.status is Status.FAIL, finding
    assert f"127.0.0.1:{port}" in finding.summary and "RAY_ADDRESS" in finding.advice


def test_no_ray_address_skips_the_ray_check(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert _launch.check_ray().status is Status.SKIP


@pytest.mark.parametrize(
    ("address", "endpoint"),
    [
        ("10.0.0.1:6380", ("10.0.0.1", 6380)),
        ("ray://head:10001", ("head", 10001)),
        ("ray://head", ("head", 10001)),
        ("[::1]:6379", ("::1", 6379)),
        ("head", ("head", 6379)),
    ],
)
def test_ray_addresses_name_their_head(address, endpoint):
    assert _launch.ray_endpoint(address) == endpoint


def test_an_unwritable_mlflow_store_is_a_warning(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    store = tmp_path / "ro"
    store.mkdir()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store / 'mlflow.db'}")
    with _read_only(store):
        finding = _storage.check_mlflow()
    assert finding.status is Status.WARN and "MLFLOW_TRACKING_URI" in finding.advice, finding
    assert not (store / "mlflow.db").exists()


def test_a_writable_mlflow_store_is_not_created(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    finding = _storage.check_mlflow()
    assert finding.status is Status.OK, finding
    assert list(tmp_path.iterdir()) == []


def _doctor(cwd: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nbtools", "doctor", "--json", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )


@pytest.fixture
def doctor_env(tmp_path) -> dict[str, str]:
    """Cache, staging and MLflow store under ``tmp_path``; no Ray."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(
        NBTOOLS_CACHE_DIR=str(tmp_path / "cache"),
        NBTOOLS_STAGING_DIR=str(tmp_path),
        MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}",
    )
    return env


@pytest.mark.slow
def test_this_machine_passes_with_one_json_object_and_nothing_written_here(tmp_path, doctor_env):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    proc = _doctor(cwd, doctor_env)
    report = json.loads(proc.stdout)  # the whole of stdout is one JSON object
    assert proc.returncode == 0 and report["exit_status"] == 0, proc.stdout + proc.stderr
    by_name = {c["name"]: c for c in report["checks"]}
    smoke = by_name["smoke launch"]
    assert smoke["details"]["results"] == [3.0, 3.0], smoke
    # Ok, or (a busy machine: over 10 s) a warning that gives the load average.
    assert smoke["status"] == "ok" or (
        smoke["status"] == "warn" and "load average" in smoke["summary"]
    ), smoke
    assert {
        "torch",
        "gpus",
        "shm",
        "open files",
        "forkserver",
        "cache dir",
        "staging dir",
        "mlflow",
        "ray",
        "settings",
    } <= set(by_name)
    assert by_name["ray"]["status"] == "skip"
    assert "cuda initialised" not in by_name  # always "no" in a fresh process: not a check
    assert report["versions"]["nbtools"] == nbtools.__version__
    assert report["versions"]["python"] == platform.python_version()
    assert report["versions"]["torch"] == importlib.metadata.version("torch")
    assert list(cwd.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cwd"]  # no cache dir, no store


@pytest.mark.slow
def test_broken_conditions_give_exit_status_1_and_say_what_to_do(tmp_path, doctor_env):
    cache = tmp_path / "cache"
    cache.mkdir()
    doctor_env["RAY_ADDRESS"] = f"127.0.0.1:{_closed_port()}"
    doctor_env["NBTOOLS_STRAGGLER_WINDOW_S"] = "soon"
    with _read_only(cache):
        proc = _doctor(tmp_path, doctor_env, "--no-smoke")
    report = json.loads(proc.stdout)
    assert proc.returncode == 1 and report["exit_status"] == 1 and not report["ok"], proc.stderr
    failed = {c["name"]: c for c in report["checks"] if c["status"] == "fail"}
    assert set(failed) == {"cache dir", "ray", "settings"}, failed
    assert all(c["advice"] for c in failed.values())
    assert "NBTOOLS_STRAGGLER_WINDOW_S='soon'" in failed["settings"]["summary"]


@pytest.mark.slow
def test_the_text_report_fits_one_screen(tmp_path, doctor_env):
    proc = subprocess.run(
        [sys.executable, "-m", "nbtools", "doctor", "--no-smoke", "--shm-dir", str(tmp_path)],
        cwd=tmp_path,
        env=doctor_env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) <= 40 and lines[-1].startswith("Training can run here"), proc.stdout
    assert lines[0] == (
        f"nbtools {nbtools.__version__} · Python {platform.python_version()} · "
        f"torch {importlib.metadata.version('torch')}"
    )


def test_version_names_nbtools_python_and_torch():
    proc = subprocess.run(
        [sys.executable, "-m", "nbtools", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == (
        f"nbtools {nbtools.__version__} · Python {platform.python_version()} · "
        f"torch {importlib.metadata.version('torch')}"
    )


class _HeldServer:
    """An MLflow tracking server stand-in on loopback that answers only when released."""

    def __init__(self) -> None:
        self.asked = threading.Event()
        self.release = threading.Event()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server.asked.set()
                server.release.wait(120)
                body = b'{"experiments": []}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.uri = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


@pytest.mark.slow
def test_each_check_is_printed_as_it_finishes(tmp_path, doctor_env):
    pytest.importorskip("mlflow")
    server = _HeldServer()
    doctor_env["MLFLOW_TRACKING_URI"] = server.uri
    proc = subprocess.Popen(
        [sys.executable, "-m", "nbtools", "doctor", "--no-smoke"],
        cwd=tmp_path,
        env=doctor_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # The MLflow check waits on the server: the lines before it are already out.
        assert server.asked.wait(120), "the doctor never asked the tracking server"
        early = [proc.stdout.readline()]
        while "] staging dir" not in early[-1] and len(early) < 20:
            early.append(proc.stdout.readline())
        assert early[0].startswith(f"nbtools {nbtools.__version__} · Python "), early
        names = [line[7:].split()[0] for line in early[1:] if line.startswith("[")]
        assert names == ["torch", "gpus", "shm", "open", "forkserver", "cache", "staging"], early
        assert proc.poll() is None  # still waiting for the server's answer
        server.release.set()
        rest, err = proc.communicate(timeout=120)
    finally:
        server.close()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, rest + err
    assert rest.splitlines()[0].startswith("[ok  ] mlflow"), rest
    assert rest.splitlines()[-1].startswith("Training can run here"), rest


def test_a_slow_smoke_launch_is_a_warning_with_the_load_average():
    slow = _launch.smoke_finding({"results": [3.0, 3.0], "seconds": 21.9})
    assert slow.status is Status.WARN, slow
    assert "21.9 s: slower than 10 s, with a load average of " in slow.summary
    assert f"on {os.cpu_count()} CPUs" in slow.summary and "load" in slow.advice
    assert len(slow.details["load_average"]) == 3
    assert exit_status([slow]) == 0  # slow is not broken
    assert _launch.smoke_finding({"results": [3.0, 3.0], "seconds": 10.04}).status is Status.OK
    quick = _launch.smoke_finding({"results": [3.0, 3.0], "seconds": 2.4})
    assert quick.status is Status.OK and "2.4 s" in quick.summary
    wrong = _launch.smoke_finding({"results": [2.0, 3.0], "seconds": 2.4})
    assert wrong.status is Status.FAIL
