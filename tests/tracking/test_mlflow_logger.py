"""MlflowLogger against a real local MLflow store (sqlite)."""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import textwrap
import threading

import pytest

from nbtools._internal.runinfo import active_mlflow_run_id
from nbtools.errors import TrackingError
from nbtools.tracking import MAX_STEPS_PER_METRIC, MlflowLogger, current_run_id


def _writer_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("nbtools-mlflow-")]


def _history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


@pytest.mark.slow
def test_metrics_reach_the_store_in_the_background_and_the_run_ends(client):
    with MlflowLogger("exp-basic", run_name="baseline") as run:
        run.flush()  # the writer is named after the run once the run is open
        assert f"nbtools-mlflow-{run.run_id[:8]}" in _writer_threads()
        for step in range(2500):  # more than one log_batch request
            run.log_metric("loss", 1.0 / (step + 1), step=step)
        run.log_metrics({"lr": 0.1, "acc": 0.5}, step=0)
        run.log_params({"lr": 0.1, "batch": 64})
        run.set_tags({"stage": "pretrain"})
        run_id = run.run_id
    assert _writer_threads() == []
    history = _history(client, run_id, "loss")
    assert [s for s, _ in history] == list(range(2500))
    assert history[9] == (9, pytest.approx(0.1))
    info = client.get_run(run_id)
    assert info.info.status == "FINISHED"
    assert info.info.run_name == "baseline"
    assert info.data.params == {"lr": "0.1", "batch": "64"}
    assert info.data.tags["stage"] == "pretrain"
    assert info.data.metrics["acc"] == 0.5
    assert client.get_experiment(info.info.experiment_id).name == "exp-basic"


def test_log_every_keeps_one_value_in_n_steps_and_steps_default_to_a_counter(client):
    with MlflowLogger("exp-throttle", log_every=10) as run:
        for step in range(95):
            run.log_metric("loss", float(step), step=step)
        for _ in range(25):
            run.log_metric("calls", 1.0)
    assert [s for s, _ in _history(client, run.run_id, "loss")] == list(range(0, 95, 10))
    assert [s for s, _ in _history(client, run.run_id, "calls")] == [0, 10, 20]


def test_a_resumed_run_continues_the_same_run_and_step_axis(client, monkeypatch):
    with MlflowLogger("exp-resume", run_name="first") as first:
        for step in range(10):
            first.log_metric("loss", float(step), step=step)
    with MlflowLogger(run_id=first.run_id) as second:
        assert current_run_id() == first.run_id
        for step in range(10, 20):
            second.log_metric("loss", float(step), step=step)
    monkeypatch.setenv("MLFLOW_RUN_ID", first.run_id)  # MLflow's own way to resume
    with MlflowLogger(run_name="renamed") as third:
        third.log_metric("loss", 20.0, step=20)
    assert third.run_id == first.run_id
    assert [s for s, _ in _history(client, first.run_id, "loss")] == list(range(21))
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "renamed"
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_nothing_is_lost_on_keyboard_interrupt_and_the_run_is_marked_killed(client):
    with pytest.raises(KeyboardInterrupt):
        with MlflowLogger("exp-interrupt", flush_interval=3600) as run:
            for step in range(1000):
                run.log_metric("loss", float(step), step=step)
            raise KeyboardInterrupt
    assert len(_history(client, run.run_id, "loss")) == 1000
    assert client.get_run(run.run_id).info.status == "KILLED"
    with pytest.raises(ValueError), MlflowLogger("exp-interrupt") as failed:
        raise ValueError("diverged")
    assert client.get_run(failed.run_id).info.status == "FAILED"


def test_the_run_id_is_visible_to_checkpoints_while_the_logger_is_open(tracking_uri):
    import mlflow

    with MlflowLogger("exp-runinfo") as run:
        assert current_run_id() == run.run_id
        assert active_mlflow_run_id() == run.run_id
        # Checkpoints are saved on other threads, where MLflow has no active run.
        seen = []
        thread = threading.Thread(target=lambda: seen.append(active_mlflow_run_id()))
        thread.start()
        thread.join()
        assert seen == [run.run_id]
        assert mlflow.active_run().info.run_id == run.run_id
    assert current_run_id() is None
    assert mlflow.active_run() is None


def test_a_run_the_user_started_is_adopted_and_left_running(client):
    import mlflow

    with mlflow.start_run(experiment_id=client.create_experiment("exp-adopt")) as outer:
        with MlflowLogger() as run:
            run.log_metric("loss", 1.0, step=0)
        assert run.run_id == outer.info.run_id
        assert mlflow.active_run().info.run_id == outer.info.run_id
        with pytest.raises(TrackingError, match="is active in this thread"):
            MlflowLogger(run_id="0" * 32)
    assert _history(client, outer.info.run_id, "loss") == [(0, 1.0)]


def test_resuming_an_unknown_run_says_what_to_do(tracking_uri):
    import mlflow

    logger = MlflowLogger(run_id="f" * 32)  # a store in this process is opened in the background
    logger.log_metric("loss", 1.0, step=0)  # logging never waits for the store
    with pytest.raises(TrackingError, match="MLFLOW_TRACKING_URI"):
        _ = logger.run_id
    with pytest.raises(TrackingError, match="MLFLOW_TRACKING_URI"):
        mlflow.log_param("lr", 0.1)  # MLflow's own calls on the active run say the same
    assert current_run_id() is None and active_mlflow_run_id() is None
    with pytest.raises(TrackingError, match="the 1 metric values logged are not in MLflow"):
        logger.close()
    assert mlflow.active_run() is None  # nothing is left on MLflow's run stack


@pytest.mark.slow
def test_the_logger_returns_while_a_new_store_is_still_being_created(tmp_path, monkeypatch, client):
    import sqlite3

    import mlflow

    database = tmp_path / "new.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{database}")
    lock = sqlite3.connect(database, isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")  # nobody can create the store's tables until this ends
    try:
        logger = MlflowLogger("exp-locked", run_name="early")
        logger.log_metric("loss", 0.5, step=0)
        assert mlflow.active_run() is not None  # already the active run of this thread
        assert "opening" in repr(logger)
    finally:
        lock.rollback()
        lock.close()
    mlflow.log_param("lr", 0.1)  # waits for the run, then lands in it
    mlflow.set_tag("stage", "warmup")
    run_id = logger.run_id
    assert mlflow.active_run().info.run_id == run_id
    logger.close()
    assert mlflow.active_run() is None
    store = mlflow.MlflowClient(tracking_uri=f"sqlite:///{database}")
    run = store.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "early"
    assert run.data.params == {"lr": "0.1"} and run.data.tags["stage"] == "warmup"
    assert _history(store, run_id, "loss") == [(0, 0.5)]


def test_warns_before_a_metric_passes_mlflows_limit(client, caplog):
    caplog.set_level(logging.WARNING, logger="nbtools")
    with MlflowLogger("exp-limit", log_every=1, total_steps=2 * MAX_STEPS_PER_METRIC) as run:
        assert "use log_every=2 or more" in caplog.text
        caplog.clear()
        run.log_metric("loss", 1.0, step=8_000_000)
        assert caplog.text == ""
        run.log_metric("loss", 1.0, step=9_500_000)
        run.log_metric("loss", 1.0, step=9_500_001)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "'loss'" in warnings[0] and "10000000" in warnings[0]


def test_other_ranks_log_nothing(client, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    before = len(client.search_runs(client.search_experiments()[0].experiment_id))
    run = MlflowLogger("exp-rank")
    assert not run.enabled and run.run_id is None and _writer_threads() == []
    run.log_metric("loss", 1.0, step=0)
    run.close()
    assert client.get_experiment_by_name("exp-rank") is None
    assert len(client.search_runs(client.search_experiments()[0].experiment_id)) == before


def test_tensor_values_and_bad_values(client):
    torch = pytest.importorskip("torch")
    with MlflowLogger("exp-values") as run:
        loss = torch.tensor(2.5)
        run.log_metric("loss", loss, step=0)
        loss.add_(1.0)  # changed in place after logging: the logged value stays 2.5
        run.log_metric("count", 3, step=0)
        with pytest.raises(ValueError, match="one number"):
            run.log_metric("loss", torch.ones(3), step=1)
        with pytest.raises(TypeError, match="must be a number"):
            run.log_metric("loss", "high", step=1)
        with pytest.raises(TypeError, match="cannot be sent to another process"):
            pickle.dumps(run)
    assert _history(client, run.run_id, "loss") == [(0, 2.5)]
    assert _history(client, run.run_id, "count") == [(0, 3.0)]
    with pytest.raises(TrackingError, match="is closed"):
        run.log_metric("loss", 1.0, step=2)
    with pytest.raises(ValueError, match="log_every"):
        MlflowLogger(log_every=0)


def test_a_failed_write_is_kept_retried_and_reported(client):
    with MlflowLogger("exp-retry") as run:
        run.log_metric("loss", 1.0, step=0)
        run.flush()
        client.delete_run(run.run_id)  # the store now refuses writes to this run
        for step in range(1, 50):
            run.log_metric("loss", float(step), step=step)
        with pytest.raises(TrackingError, match="kept and retried"):
            run.flush()
        client.restore_run(run.run_id)
        run.flush()
    assert [s for s, _ in _history(client, run.run_id, "loss")] == list(range(50))


@pytest.mark.slow
def test_a_logger_left_open_is_flushed_and_ended_when_the_interpreter_exits(client, tracking_uri):
    script = textwrap.dedent(
        """
        from nbtools.tracking import MlflowLogger
        run = MlflowLogger("exp-atexit", flush_interval=3600)  # never closed, never flushed
        for step in range(3000):
            run.log_metric("loss", float(step), step=step)
        print(run.run_id)
        """
    )
    env = dict(os.environ, MLFLOW_TRACKING_URI=tracking_uri)
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    run_id = proc.stdout.strip().splitlines()[-1]
    assert len(_history(client, run_id, "loss")) == 3000
    assert client.get_run(run_id).info.status == "FINISHED"


def test_experiment_choice_follows_mlflows_conventions(client, monkeypatch):
    chosen = client.create_experiment("set-by-mlflow.set_experiment")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", chosen)  # what mlflow.set_experiment() sets
    with MlflowLogger() as run:
        pass
    assert run.experiment_id == chosen
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "by-name")  # the name wins over the id
    with MlflowLogger() as run:
        pass
    assert client.get_experiment(run.experiment_id).name == "by-name"
    with MlflowLogger("explicit") as run:  # and an explicit argument over both
        pass
    assert client.get_experiment(run.experiment_id).name == "explicit"


def test_an_invalid_metric_name_is_refused_before_it_is_queued(client):
    with MlflowLogger("exp-names") as run:
        with pytest.raises(ValueError, match=r"invalid metric name 'loss\?'.*alphanumerics"):
            run.log_metric("loss?", 1.0, step=0)
        with pytest.raises(ValueError, match="relative path"):
            run.log_metric("../loss", 1.0, step=0)
        with pytest.raises(ValueError, match="MLflow allows 250"):
            run.log_metric("x" * 251, 1.0, step=0)
        with pytest.raises(TypeError, match="metric name must be a string"):
            run.log_metric(3, 1.0, step=0)
        for step in range(100):
            run.log_metric("train/loss", float(step), step=step)
        run.flush()  # nothing bad was queued: success is true
        assert run.dropped == 0
    assert [s for s, _ in _history(client, run.run_id, "train/loss")] == list(range(100))


def test_values_the_store_refuses_are_dropped_alone_and_flush_says_how_many(client, caplog):
    from nbtools.monitor import Sample, SimulatedBackend
    from nbtools.tracking import SystemMetricsSink

    caplog.set_level(logging.WARNING, logger="nbtools")
    # A node whose host name MLflow refuses in a metric name: its 5 values per sample.
    remote = SimulatedBackend(1, host="node?b")
    with MlflowLogger("exp-refused", flush_interval=3600) as run:
        sink = SystemMetricsSink(run, local_host="here")
        for step in range(3000):
            run.log_metric("loss", float(step), step=step)
            if step == 1500:
                sink(Sample("node?b", 1000.0, tuple(remote.read(1000.0))))
        with pytest.raises(TrackingError, match="5 metric values were dropped.*'system/node_node"):
            run.flush()
        assert run.dropped == 5 and "MLflow refused metric" in caplog.text
        for step in range(3000, 3100):  # later values are not held back by the refused ones
            run.log_metric("loss", float(step), step=step)
        run.flush()  # nothing new was dropped
    assert [s for s, _ in _history(client, run.run_id, "loss")] == list(range(3100))


def test_a_full_queue_makes_the_caller_wait_for_the_writer(client):
    with MlflowLogger("exp-backpressure", flush_interval=3600, max_pending=50) as run:
        peak = 0
        for step in range(2000):
            run.log_metric("loss", float(step), step=step)
            peak = max(peak, run.pending)
        assert peak <= 2 * 50  # 50 waiting, at most 50 more in the write under way
        run.flush()
        assert run.dropped == 0
    assert [s for s, _ in _history(client, run.run_id, "loss")] == list(range(2000))


def test_a_full_queue_while_the_store_fails_drops_and_counts_instead_of_blocking(client):
    with MlflowLogger("exp-full-failing", flush_interval=3600, max_pending=20) as run:
        run.log_metric("loss", 0.0, step=0)
        run.flush()
        client.delete_run(run.run_id)  # the store now refuses every write to this run
        for step in range(1, 101):
            run.log_metric("loss", float(step), step=step)  # returns: training goes on
        dropped = run.dropped
        assert dropped > 0
        with pytest.raises(TrackingError, match=f"{dropped} metric values were dropped"):
            run.flush()
        client.restore_run(run.run_id)
        run.flush()  # the kept values are written; the drops were reported once
    steps = [s for s, _ in _history(client, run.run_id, "loss")]
    assert len(steps) + dropped == 101 and steps[0] == 0


def test_steps_that_run_again_after_a_restore_are_not_logged_twice(client):
    with MlflowLogger("exp-rerun") as first:
        for step in range(30):  # checkpoint at step 19, then interrupted at step 29
            first.log_metric("loss", float(step), step=step)
    with MlflowLogger(run_id=first.run_id) as second:
        for step in range(20, 40):  # restored: steps 20..29 run again
            second.log_metric("loss", 100.0 + step, step=step)
            second.log_metric("lr", 0.1, step=step)  # a metric new to the run is all kept
        second.flush()
        assert second.dropped == 0
    history = _history(client, first.run_id, "loss")
    assert [s for s, _ in history] == list(range(40))  # each step once
    assert history[25] == (25, 25.0) and history[35] == (35, 135.0)
    assert [s for s, _ in _history(client, first.run_id, "lr")] == list(range(20, 40))


def test_close_reports_what_it_could_not_write_in_its_time(client):
    with MlflowLogger("exp-close-lost", flush_interval=3600, close_timeout=1) as run:
        run.log_metric("loss", 0.0, step=0)
        run.flush()
        client.delete_run(run.run_id)
        for step in range(1, 40):
            run.log_metric("loss", float(step), step=step)
        with pytest.raises(
            TrackingError, match="39 metric values were dropped.*within 1 s of close"
        ):
            run.close()
        client.restore_run(run.run_id)
    assert run.closed and _writer_threads() == []
    assert [s for s, _ in _history(client, run.run_id, "loss")] == [0]


def test_end_is_gone_and_the_new_settings_are_checked(tracking_uri):
    assert not hasattr(MlflowLogger, "end")
    with pytest.raises(TypeError, match="max_pending must be an integer"):
        MlflowLogger(max_pending="10")
    with pytest.raises(ValueError, match="max_pending must be at least 1"):
        MlflowLogger(max_pending=0)
    with pytest.raises(ValueError, match="close_timeout must be a finite"):
        MlflowLogger(close_timeout=float("inf"))
