"""Starting, resuming or adopting the MLflow run of an :class:`~nbtools.tracking.MlflowLogger`.

A store that lives in this process (a sqlite, file or database URI) is opened by
MLflow on first use: imports, schema checks and, for a new database, its
migrations, 1-10 s. That work runs on a background thread, so the notebook's
training loop starts at once. The run is nevertheless MLflow's active run in the
caller's thread from the moment the logger exists: a :class:`PendingRun` stands
in for it on MLflow's run stack, and whatever reads the run (``mlflow.log_param``,
``mlflow.active_run().info``, a checkpoint recording the run id) waits for it.

A tracking server (http/https) is asked before the constructor returns, so a
server that is not there is a :class:`~nbtools.errors.TrackingError` at once.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import mlflow
from mlflow.exceptions import MlflowException

from nbtools._internal.log import get_logger
from nbtools.errors import TrackingError
from nbtools.tracking._local_store import open_store
from nbtools.tracking._mlflow_compat import run_stack
from nbtools.tracking._store import bounded_requests, is_http, probe
from nbtools.tracking.naming import experiment_name as _default_experiment_name
from nbtools.tracking.naming import notebook_path

__all__ = ["PendingRun", "RunHandle", "end_run", "leave", "open_run"]

_log = get_logger("tracking")


class RunHandle:
    """The logger's run and a client for its store, ready now or once the background start ends.

    Attributes:
        uri: The tracking URI.
        owned: The logger started or resumed the run (and so ends it).
        resumed: The run existed before (it may hold values).
    """

    def __init__(self, uri: str, *, owned: bool, resumed: bool) -> None:
        self.uri = uri
        self.owned = owned
        self.resumed = resumed
        self._done = threading.Event()
        self._run: Any = None
        self._client: Any = None
        self._error: TrackingError | None = None
        self._thread: threading.Thread | None = None
        self._stack: list[Any] | None = None  # the opening thread's run stack, holding a PendingRun

    def _set(self, run: Any, client: Any) -> None:
        self._run, self._client = run, client
        self._done.set()

    def _fail(self, error: TrackingError) -> None:
        self._error = error
        self._done.set()

    @property
    def ready(self) -> bool:
        """True once the run is open or its start failed."""
        return self._done.is_set()

    def settled(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for the start to end; True once it has."""
        if not self._done.wait(timeout):
            return False
        if self._thread is not None:
            self._thread.join(timeout)  # it only returns after settling: no thread left behind
        return True

    @property
    def failed(self) -> TrackingError | None:
        """Why the run could not be opened, once that is known."""
        return self._error if self._done.is_set() else None

    def wait(self) -> Any:
        """The run (an ``mlflow.entities.Run``), waiting for the background start.

        Raises:
            TrackingError: The run could not be started, resumed or adopted.
        """
        self._done.wait()
        if self._error is not None:
            raise TrackingError(str(self._error)) from self._error
        return self._run

    @property
    def client(self) -> Any:
        """An ``mlflow.MlflowClient`` for the run's store (waits like :meth:`wait`)."""
        self.wait()
        return self._client


class PendingRun(mlflow.ActiveRun):
    """MLflow's active run while it is being opened in the background.

    It sits on MLflow's run stack of the caller's thread in place of the
    ``ActiveRun`` that ``mlflow.start_run`` would have put there; reading
    ``info``, ``data``, ``inputs`` or ``outputs`` waits for the run.
    """

    def __init__(self, handle: RunHandle) -> None:  # no Run to copy yet
        self.handle = handle

    @property
    def info(self) -> Any:
        return self.handle.wait().info

    @property
    def data(self) -> Any:
        return self.handle.wait().data

    @property
    def inputs(self) -> Any:
        return self.handle.wait().inputs

    @property
    def outputs(self) -> Any:
        return self.handle.wait().outputs

    def __repr__(self) -> str:
        state = (
            "starting" if not self.handle.ready else ("failed" if self.handle.failed else "open")
        )
        return f"<PendingRun {state} at {self.handle.uri}>"


def open_run(
    uri: str,
    experiment: str | None,
    run_name: str | None,
    run_id: str | None,
    tags: dict[Any, Any],
) -> RunHandle:
    """Make the logger's run MLflow's active run in this thread.

    Raises:
        TrackingError: The server does not answer, the run cannot be resumed (a
            server store), or another run is active in this thread.
    """
    active = mlflow.active_run()
    if active is not None:
        if run_id is None or run_id == active.info.run_id:
            handle = RunHandle(
                uri, owned=False, resumed=True
            )  # the caller's run, not ended by close()
            handle._set(active, mlflow.MlflowClient(tracking_uri=uri))
            return handle
        raise TrackingError(
            f"MLflow run {active.info.run_id} is active in this thread, so run {run_id} "
            "cannot be resumed; close the MlflowLogger that started it, or call "
            "mlflow.end_run(), first"
        )
    if run_id is None:
        source = notebook_path()
        if source:
            tags.setdefault("mlflow.source.name", source)
            tags.setdefault("mlflow.source.type", "NOTEBOOK")
        experiment = _experiment_choice(experiment)
    handle = RunHandle(uri, owned=True, resumed=run_id is not None)
    stack = run_stack()
    if is_http(uri) or stack is None:
        probe(uri)  # a server that is not there is reported in seconds, not minutes
        _start(handle, experiment, run_name, run_id, tags, background=False)
        handle.wait()
        return handle
    stack.append(PendingRun(handle))
    handle._stack = stack
    handle._thread = threading.Thread(
        target=_start,
        args=(handle, experiment, run_name, run_id, tags),
        kwargs={"background": True},
        name="nbtools-mlflow-start",
        daemon=True,
    )
    handle._thread.start()
    return handle


def leave(handle: RunHandle) -> bool:
    """Take the handle's stand-in off the run stack of the thread that opened it.

    Returns:
        True when it was still there (the run was not ended through MLflow).
    """
    stack = handle._stack
    if stack:
        for index in range(len(stack) - 1, -1, -1):
            if isinstance(stack[index], PendingRun) and stack[index].handle is handle:
                del stack[index]
                return True
    return False


def end_run(handle: RunHandle, status: str) -> None:
    """Mark the handle's (open) run ended with ``status`` and take it off MLflow's run stack.

    Raises:
        TrackingError: The store could not be told; the run stays RUNNING there.
    """
    run_id = handle.wait().info.run_id
    try:
        with bounded_requests(handle.uri):
            active = mlflow.active_run()
            if active is not None and active.info.run_id == run_id:
                mlflow.end_run(status)  # leaves this thread's active runs even when it fails
            else:  # opened by another thread: end it through the client
                leave(handle)
                handle.client.set_terminated(run_id, status)
    except MlflowException as exc:
        raise TrackingError(
            f"MLflow run {run_id} could not be marked {status} at {handle.uri} "
            f"({exc.message}); it stays RUNNING there until set, e.g. with "
            f"MlflowClient().set_terminated({run_id!r})"
        ) from exc


def _start(
    handle: RunHandle,
    experiment: str | None,
    run_name: str | None,
    run_id: str | None,
    tags: dict[Any, Any],
    *,
    background: bool,
) -> None:
    uri = handle.uri
    try:
        client = open_store(uri)  # the slow part; a new sqlite store is created under a lock
        if run_id is not None:
            kwargs: dict[str, Any] = {"run_id": run_id}
        else:
            # Without a run id the caller has resolved the experiment (_experiment_choice).
            assert experiment is not None
            kwargs = {"experiment_id": _experiment_id(client, experiment)}
        run = mlflow.start_run(run_name=run_name, tags=tags or None, **kwargs)
        if background:
            leave_stack = run_stack()
            if leave_stack:
                leave_stack.pop()  # the run belongs to the caller's thread, not this one
        handle._set(run, client)
    except (MlflowException, TrackingError, OSError, ImportError) as exc:
        handle._fail(_explain(exc, uri, run_id))
        if background:
            _log.warning("%s; metrics logged meanwhile are not recorded", handle._error)
    except Exception as exc:  # noqa: BLE001 - a store error of any kind must reach the caller
        handle._fail(TrackingError(f"cannot open the MLflow store at {uri}: {exc!r}"))
        if background:
            _log.warning("%s; metrics logged meanwhile are not recorded", handle._error)


def _explain(exc: BaseException, uri: str, run_id: str | None) -> TrackingError:
    if isinstance(exc, TrackingError):
        return exc
    message = exc.message if isinstance(exc, MlflowException) else str(exc)
    what = f"resume MLflow run {run_id}" if run_id else "start an MLflow run"
    hint = (
        "; point MLFLOW_TRACKING_URI at the store that holds it, or pass run_id=None "
        "(and unset MLFLOW_RUN_ID) to start a new run"
        if run_id
        else ""
    )
    error = TrackingError(f"cannot {what} at {uri}: {message}{hint}")
    error.__cause__ = exc
    return error


def _experiment_choice(name: str | None) -> str:
    """The experiment of a new run, read in the caller's thread: a name, or ``id:<id>``."""
    if name is None and not os.environ.get("MLFLOW_EXPERIMENT_NAME"):
        from_env = os.environ.get("MLFLOW_EXPERIMENT_ID")
        if from_env:
            return f"id:{from_env}"
    return f"name:{name or _default_experiment_name()}"


def _experiment_id(client: Any, choice: str) -> str:
    kind, _, name = choice.partition(":")
    if kind == "id":
        return name
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        try:
            return client.create_experiment(name)
        except MlflowException:
            experiment = client.get_experiment_by_name(name)  # created meanwhile
            if experiment is None:
                raise
    if experiment.lifecycle_stage == "deleted":
        raise TrackingError(
            f"MLflow experiment {name!r} is deleted; restore it "
            f"(mlflow experiments restore --experiment-id {experiment.experiment_id}) "
            "or choose another name"
        )
    return experiment.experiment_id
