"""A real ``mlflow server`` on loopback: a run is logged, interrupted, resumed, and is one run."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from nbtools.errors import TrackingError
from nbtools.tracking import MlflowLogger

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    """Stop the server and every process it started."""
    try:
        family = [proc, *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    for signum in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=15)
            break
        except subprocess.TimeoutExpired:
            continue
    psutil.wait_procs([p for p in family if isinstance(p, psutil.Process)], timeout=10)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One ``mlflow server`` for this file (a start costs seconds): yields ``(uri, process)``.

    The last test stops it mid-run; the fixture stops it again (a no-op) at the end.
    """
    with _server(tmp_path_factory.mktemp("mlflow-server")) as started:
        yield started


@pytest.fixture
def mlflow_server(server):
    """The running server's URI."""
    uri, proc = server
    assert proc.poll() is None, "the module's mlflow server has stopped"
    return uri


@contextlib.contextmanager
def _server(tmp_path: Path):
    """Start ``mlflow server``; yields ``(uri, process)``; stops it (again) on the way out."""
    if shutil.which("mlflow") is None:
        pytest.skip("the mlflow command is not installed")
    port = _free_port()
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = dict(
        os.environ,
        TMPDIR=str(scratch),
        MLFLOW_DISABLE_TELEMETRY="true",
        # The job runner starts a dozen processes and a /dev/shm queue; not needed here.
        MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false",
    )
    env.pop("MLFLOW_TRACKING_URI", None)
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{tmp_path / 'server.db'}",
            "--artifacts-destination",
            str(tmp_path / "artifacts"),
        ],
        cwd=tmp_path,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    "mlflow server exited:\n" + (tmp_path / "server.log").read_text()[-3000:]
                )
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=1) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("mlflow server did not answer within 90 s")
            time.sleep(0.2)
        yield uri, proc
    finally:
        _stop(proc)
        log.close()
    assert (
        not psutil.pid_exists(proc.pid) or psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE
    )


def test_a_resumed_run_on_a_tracking_server_is_one_run(mlflow_server, monkeypatch):
    from mlflow import MlflowClient

    for name in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    with pytest.raises(KeyboardInterrupt):
        with MlflowLogger("server-exp", run_name="resilient", log_every=2) as first:
            for step in range(40):
                first.log_metric("loss", 1.0 / (step + 1), step=step)
                if step == 25:
                    raise KeyboardInterrupt  # the kernel is interrupted mid-run
    with MlflowLogger(run_id=first.run_id, log_every=2) as second:
        for step in range(26, 60):
            second.log_metric("loss", 1.0 / (step + 1), step=step)
    client = MlflowClient(tracking_uri=mlflow_server)
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "resilient"
    steps = sorted(m.step for m in client.get_metric_history(first.run_id, "loss"))
    assert steps == list(range(0, 60, 2))
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_a_server_that_is_not_there_at_start_is_a_clear_error(monkeypatch):
    for name in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{_free_port()}")  # nothing listens
    # Before: MLflow's own retries took about 4 minutes (past this suite's 300 s test timeout).
    with pytest.raises(TrackingError, match="does not answer.*MLFLOW_TRACKING_URI"):
        MlflowLogger("nowhere")
    import mlflow

    assert mlflow.active_run() is None


def test_close_with_the_server_gone_returns_and_says_how_many_values_were_lost(server, monkeypatch):
    """Last in this file: it stops the module's server."""
    from mlflow import MlflowClient

    for name in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.delenv(name, raising=False)
    uri, proc = server
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    run = MlflowLogger("server-gone", flush_interval=3600, close_timeout=5)
    for step in range(100):
        run.log_metric("loss", float(step), step=step)
    run.flush()
    assert [m.step for m in MlflowClient(uri).get_metric_history(run.run_id, "loss")] == list(
        range(100)
    )
    _stop(proc)  # the tracking server goes away mid-run
    for step in range(100, 150):
        run.log_metric("loss", float(step), step=step)
    # Before: close() was still waiting after 6 minutes (past this suite's test timeout).
    with pytest.raises(TrackingError) as raised:
        run.close()
    assert "50 metric values were dropped" in str(raised.value)
    assert "could not be marked FINISHED" in str(raised.value)  # nor could the run be ended there
    assert run.closed and run.dropped == 50
    assert not [t for t in threading.enumerate() if t.name.startswith("nbtools-mlflow-")]
    import mlflow

    assert mlflow.active_run() is None
