"""The seam between the launcher and MLflow, in real interpreters set up as ranks are.

``hooks.rank_started()`` is what the launcher calls at a rank's start; these
tests call it in a fresh interpreter whose environment says rank 1 (or 0) of 2,
and then run a training script's MLflow calls against a real sqlite store.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from mlflow import MlflowClient

SCRIPT = """
    import json, sys
    from nbtools._internal import hooks
    import nbtools                                    # registers the integrations

    hooks.rank_started()
    imported_early = "mlflow" in sys.modules
    import mlflow

    with mlflow.start_run(run_name="fit") as run:
        mlflow.log_param("lr", 0.1)
        mlflow.log_metric("loss", 0.5, step=0)
        mlflow.set_tag("phase", "train")
        active = mlflow.active_run().info.run_id
    with mlflow.start_run(run_id="0123abcd") as resumed:
        same = resumed.info.run_id
    print(json.dumps({"early": imported_early, "id": run.info.run_id, "active": active,
                      "resumed": same, "after": mlflow.active_run() is None}))
"""


def _as_rank(rank: int, uri: str) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update(
        RANK=str(rank),
        WORLD_SIZE="2",
        MLFLOW_TRACKING_URI=uri,
        MLFLOW_DISABLE_TELEMETRY="true",
        MLFLOW_EXPERIMENT_NAME="/Users/t/seam",
    )
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    return (
        json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {}
    ), out.stderr


@pytest.mark.slow
def test_a_rank_other_than_zero_records_nothing_and_its_script_still_runs(tmp_path):
    db = tmp_path / "mlflow.db"
    seen, err = _as_rank(1, f"sqlite:///{db}")
    assert seen, err
    assert seen["early"] is False, "mlflow is imported only when the rank's code imports it"
    assert seen["active"] == seen["id"] and seen["after"] is True
    assert seen["resumed"] == "0123abcd", "a resumed run keeps the id asked for"
    assert not db.exists(), "rank 1 never touched the store"
    # Its code started runs: it says once what they are (no process group: once per process).
    assert err.count("rank 0 records the runs. On rank 1, mlflow.start_run() returns") == 1, err


@pytest.mark.slow
def test_a_rank_other_than_zero_that_starts_no_run_says_nothing(tmp_path):
    script = "from nbtools._internal import hooks\nimport nbtools\nhooks.rank_started()\n"
    script += "import mlflow\nmlflow.log_metric('x', 1.0)\nprint(mlflow.active_run())"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update(RANK="1", WORLD_SIZE="3", MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'm.db'}")
    env["MLFLOW_DISABLE_TELEMETRY"] = "true"
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "None" and "records nothing" not in out.stderr


@pytest.mark.slow
def test_rank_zero_is_unchanged_and_says_nothing_of_other_ranks(tmp_path, mlflow_store):
    uri = mlflow_store(tmp_path / "mlflow.db")  # the kernel created the store
    seen, err = _as_rank(0, uri)
    # Rank 0 resumes only real runs: the made-up id of the script is refused there.
    assert not seen and "0123abcd" in err
    assert "rank 0 records the runs" not in err  # the rank that starts a quiet run says it
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("/Users/t/seam").experiment_id])
    assert [r.info.run_name for r in runs] == ["fit"]
    assert runs[0].data.params == {"lr": "0.1"} and runs[0].data.metrics == {"loss": 0.5}


KERNEL = """
    import json, os, sys
    import cloudpickle
    import nbtools
    from nbtools._internal import hooks

    def plain():
        return 1

    def tracked():
        import mlflow
        mlflow.log_metric("x", 1.0)

    hooks.before_launch(cloudpickle.dumps((plain, (), {})))
    plain_imported = "mlflow" in sys.modules
    hooks.before_launch(cloudpickle.dumps((tracked, (), {})))
    print(json.dumps({"plain": plain_imported, "db": os.path.exists(sys.argv[1])}))
"""


@pytest.mark.slow
def test_the_kernel_creates_the_store_only_for_code_that_uses_mlflow(tmp_path):
    db = tmp_path / "new" / "mlflow.db"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update(MLFLOW_TRACKING_URI=f"sqlite:///{db}", MLFLOW_DISABLE_TELEMETRY="true")
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(KERNEL), str(db)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"plain": False, "db": True}, out.stderr
    assert MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments(), "a complete store"


CHOSEN_IN_KERNEL = """
    import json, os, subprocess, sys, textwrap
    import cloudpickle
    import mlflow
    import nbtools
    from nbtools._internal import hooks

    os.environ["MLFLOW_EXPERIMENT_NAME"] = "/Users/t/documented"  # first, as documented
    mlflow.set_tracking_uri("sqlite:///chosen.db")    # then in code: relative to the kernel
    for name in ("/Users/t/documented", "/Users/t/own"):
        mlflow.MlflowClient().create_experiment(name)
    mlflow.set_experiment("/Users/t/chosen")           # the kernel's MLflow now uses this one

    def train():
        import mlflow
        mlflow.log_metric("x", 1.0)

    hooks.before_launch(cloudpickle.dumps((train, (), {})))
    rank = '''
    import os, mlflow
    with mlflow.start_run(run_name="inherited"):
        mlflow.log_metric("x", 1.0)
    os.environ["MLFLOW_EXPERIMENT_NAME"] = "/Users/t/own"   # set in the function: it wins
    with mlflow.start_run(run_name="own"):
        pass
    '''
    os.makedirs("rank", exist_ok=True)  # a rank may run elsewhere (the kernel changed directory)
    env = dict(os.environ, RANK="0", WORLD_SIZE="1")  # what a rank inherits at its start
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(rank)], env=env, cwd="rank",
                         capture_output=True, text=True)
    print(json.dumps({"rc": out.returncode, "err": out.stderr[-2000:]}))
"""


@pytest.mark.slow
def test_the_tracking_uri_and_experiment_chosen_in_the_kernel_reach_the_ranks(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update(MLFLOW_DISABLE_TELEMETRY="true")
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHOSEN_IN_KERNEL)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["rc"] == 0, seen["err"]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'chosen.db'}")
    names = {}
    for experiment in client.search_experiments():
        for run in client.search_runs([experiment.experiment_id]):
            names[run.info.run_name] = experiment.name
    assert names == {"inherited": "/Users/t/chosen", "own": "/Users/t/own"}
    assert os.listdir(tmp_path / "rank") == [], "the rank made no store of its own"
