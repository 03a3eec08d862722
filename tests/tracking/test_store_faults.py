"""A local sqlite store that cannot work, and one that several processes create at once.

Every case runs real interpreters against real sqlite files: the faults live in
the file system and in MLflow's own start-up, which one process cannot fake.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from nbtools.tracking._local_store import LOCK_SUFFIX, sqlite_path

# MLflow's warning for each of its own attempts at creating the store's engine.
_ENGINE_RETRY = "SQLAlchemy engine could not be created"


def _env(uri: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update(MLFLOW_TRACKING_URI=uri, MLFLOW_DISABLE_TELEMETRY="true")
    return env


def _python(code: str, uri: str, **popen: object) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=_env(uri),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory nobody here may create files in (root too: the immutable attribute)."""
    path = tmp_path / "ro"
    path.mkdir()
    if os.geteuid() == 0:
        if shutil.which("chattr") is None:
            pytest.skip("making a directory read-only for root needs chattr")
        done = subprocess.run(["chattr", "+i", str(path)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(
                f"this file system has no immutable attribute: {done.stderr.decode().strip()}"
            )
        undo = ["chattr", "-i", str(path)]
    else:
        path.chmod(0o555)
        undo = ["chmod", "755", str(path)]
    yield path
    subprocess.run(undo, check=True)


@pytest.mark.slow
def test_a_store_that_cannot_be_written_is_reported_at_once_as_permanent(read_only_dir):
    uri = f"sqlite:///{read_only_dir / 'mlflow.db'}"
    proc = _python(
        """
        import json
        from nbtools.errors import TrackingError
        from nbtools.tracking import MlflowLogger

        logger = MlflowLogger(experiment_name="read-only", run_name="r")
        for step in range(1000):
            logger.log_metric("loss", float(step), step=step)
        try:
            logger.flush()
            seen = None
        except TrackingError as exc:
            seen = {"type": type(exc).__name__, "permanent": exc.permanent, "message": str(exc)}
        try:
            logger.close()
        except TrackingError:
            pass
        print(json.dumps(seen))
        """,
        uri,
    )
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen is not None, "flush raised nothing"
    assert err.count(_ENGINE_RETRY) == 0, "MLflow was left to retry a store that cannot work"
    assert seen["type"] == "TrackingStoreError" and seen["permanent"] is True
    assert "the 1000 metric values logged are not in MLflow" in seen["message"]
    assert "writable" in seen["message"], "the message says what to do"


@pytest.mark.slow
def test_two_processes_creating_one_new_store_at_once_keep_both_runs(tmp_path):
    db = tmp_path / "new" / "mlflow.db"
    uri = f"sqlite:///{db}"
    go = tmp_path / "go"
    code = f"""
        import os, sys, time
        from nbtools.tracking import MlflowLogger   # the slow imports, before the start line

        name = sys.argv[1]
        open(os.path.join({str(tmp_path)!r}, "ready-" + name), "w").close()
        while not os.path.exists({str(go)!r}):
            time.sleep(0.01)
        # close waits for the run to open too: the second one waits for the first one's creation
        with MlflowLogger(experiment_name="shared", run_name=name, close_timeout=180) as logger:
            for step in range(200):
                logger.log_metric("loss", float(step), step=step)
        print(logger.run_id)
    """
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code), name],
            env=_env(uri),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in ("kernel-a", "kernel-b")
    ]
    try:
        deadline = time.monotonic() + 240
        while not all((tmp_path / f"ready-{n}").exists() for n in ("kernel-a", "kernel-b")):
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
            assert time.monotonic() < deadline, "the processes did not get ready"
            time.sleep(0.05)
        go.touch()  # both open the new store now
        outcomes = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_out, err) in zip(procs, outcomes, strict=True):
        assert p.returncode == 0 and "TrackingError" not in err, err[-3000:]

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("shared")
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["kernel-a", "kernel-b"]
    for run in runs:
        history = client.get_metric_history(run.info.run_id, "loss")
        assert sorted(m.step for m in history) == list(range(200)), run.info.run_name
    assert os.path.exists(str(db) + LOCK_SUFFIX), "creation went through the lock next to the db"


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("sqlite:///rel/mlflow.db", os.path.abspath("rel/mlflow.db")),
        ("sqlite:////abs/mlflow.db", "/abs/mlflow.db"),
        ("sqlite:///:memory:", None),
        ("sqlite://", None),
        ("sqlite:///file:x.db?mode=ro&uri=true", None),
        ("http://127.0.0.1:5000", None),
        ("file:///tmp/mlruns", None),
    ],
)
def test_which_uris_name_a_local_sqlite_file(uri, expected):
    assert sqlite_path(uri) == expected
