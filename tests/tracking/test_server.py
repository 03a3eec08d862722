"""A real ``mlflow server`` on loopback: a run is logged, interrupted, resumed, and is one run."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

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


@pytest.fixture
def mlflow_server(tmp_path: Path):
    """``mlflow server`` with a sqlite store in tmp_path; yields its URI, then stops it."""
    if shutil.which("mlflow") is None:
        pytest.skip("the mlflow command is not installed")
    port = _free_port()
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = dict(os.environ, TMPDIR=str(scratch), MLFLOW_DISABLE_TELEMETRY="true",
               # The job runner starts a dozen processes and a /dev/shm queue; not needed here.
               MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    env.pop("MLFLOW_TRACKING_URI", None)
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
         "--artifacts-destination", str(tmp_path / "artifacts")],
        cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                pytest.fail("mlflow server exited:\n" + (tmp_path / "server.log").read_text()[-3000:])
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=1) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("mlflow server did not answer within 90 s")
            time.sleep(0.2)
        yield uri
    finally:
        _stop(proc)
        log.close()
    assert not psutil.pid_exists(proc.pid) or psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE


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
