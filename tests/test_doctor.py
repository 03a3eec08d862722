"""``python -m nbtools doctor``: this machine passes; each broken condition is caught.

Broken conditions are real ones: a tmpfs of 16 MiB mounted as the shared-memory filesystem,
a cache directory on a read-only bind mount (root) or without write permission (other
users), a ``RAY_ADDRESS`` whose port nothing listens on. The checks are run in-process where
that is enough, and through the command line for the exit status and the JSON output.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

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
    assert by_name["smoke launch"]["status"] == "ok" and by_name["smoke launch"]["details"][
        "results"
    ] == [3.0, 3.0]
    assert {
        "torch",
        "gpus",
        "cuda initialised",
        "shm",
        "open files",
        "forkserver",
        "cache dir",
        "staging dir",
        "mlflow",
        "ray",
    } <= set(by_name)
    assert by_name["ray"]["status"] == "skip"
    assert list(cwd.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cwd"]  # no cache dir, no store


@pytest.mark.slow
def test_broken_conditions_give_exit_status_1_and_say_what_to_do(tmp_path, doctor_env):
    cache = tmp_path / "cache"
    cache.mkdir()
    doctor_env["RAY_ADDRESS"] = f"127.0.0.1:{_closed_port()}"
    with _read_only(cache):
        proc = _doctor(tmp_path, doctor_env, "--no-smoke")
    report = json.loads(proc.stdout)
    assert proc.returncode == 1 and report["exit_status"] == 1 and not report["ok"], proc.stderr
    failed = {c["name"]: c for c in report["checks"] if c["status"] == "fail"}
    assert set(failed) == {"cache dir", "ray"}, failed
    assert all(c["advice"] for c in failed.values())


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
