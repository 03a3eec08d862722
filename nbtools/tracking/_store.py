"""The tracking store as nbtools talks to it: bounded in time, whatever the server does.

MLflow's REST client retries a refused connection 7 times with exponential
back-off (``MLFLOW_HTTP_REQUEST_MAX_RETRIES``, ``..._BACKOFF_FACTOR``): about
four minutes before an error. That suits one interactive call, not a writer
that must be able to stop. nbtools therefore passes its own, bounded policy to
MLflow's request helper (``mlflow.utils.rest_utils.http_request``) for the calls
it makes itself, and leaves MLflow's settings alone for everything else:

- :func:`probe`: is the server there at all (before a run is started);
- :func:`write_metrics`: one batch of metric values (the writer retries on its
  own schedule, so each write may fail fast);
- :func:`bounded_requests`: MLflow calls that have no such parameter (ending a
  run), with the bounded policy in MLflow's environment variables for the
  duration of the call only; values the user set are kept.

Local stores (sqlite, files) need none of this: they are called directly.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from mlflow.exceptions import MlflowException

from nbtools.errors import TrackingError

__all__ = [
    "PROBE_SECONDS",
    "REQUEST_TIMEOUT",
    "REQUEST_RETRIES",
    "bounded_requests",
    "is_http",
    "is_rejection",
    "probe",
    "write_metrics",
]

#: Seconds one HTTP attempt may take (connect and read).
REQUEST_TIMEOUT = 10
#: Retries of one HTTP request after the first attempt (back-off 1 s, then 2 s).
REQUEST_RETRIES = 2
_BACKOFF = 1
#: Seconds a start waits at most to learn that the tracking server is not there.
PROBE_SECONDS = 5
# MLflow's own limit on metrics per log-batch request.
_PER_REQUEST = 1000
_ENV_LOCK = threading.Lock()


def is_http(uri: str) -> bool:
    """True for a tracking server reached over HTTP(S)."""
    return uri.startswith(("http://", "https://"))


def is_rejection(exc: BaseException) -> bool:
    """True when the store refused the request itself (HTTP 400), not when it could not be reached."""
    return isinstance(exc, MlflowException) and exc.get_http_status_code() == 400


def _host_creds(uri: str) -> Any:
    from mlflow.utils.credentials import get_default_host_creds

    return get_default_host_creds(uri)


def probe(uri: str) -> None:
    """Check that the tracking server at ``uri`` answers; a no-op for local stores.

    One attempt of at most :data:`PROBE_SECONDS`, retried once a second later:
    any HTTP answer (even an error status) counts as "there".

    Raises:
        TrackingError: Nothing answered.
    """
    if not is_http(uri):
        return
    from mlflow.utils.rest_utils import http_request

    try:
        http_request(
            _host_creds(uri),
            "/api/2.0/mlflow/experiments/search",
            "GET",
            max_retries=1,
            backoff_factor=_BACKOFF,
            timeout=PROBE_SECONDS,
            raise_on_status=False,
            params={"max_results": 1},
        )
    except MlflowException as exc:
        raise TrackingError(
            f"the MLflow tracking server at {uri} does not answer ({exc.message}); start it, "
            "or point MLFLOW_TRACKING_URI at a running server or a local store "
            "(e.g. sqlite:///mlflow.db)"
        ) from exc


def write_metrics(client: Any, uri: str, run_id: str, metrics: Sequence[Any]) -> None:
    """Write Metric entities to the run; over HTTP with the bounded policy, in requests of 1,000.

    Raises:
        MlflowException: The store refused the values or could not be reached.
    """
    if not is_http(uri):
        client.log_batch(run_id, metrics=list(metrics))
        return
    from mlflow.protos.service_pb2 import LogBatch
    from mlflow.utils.proto_json_utils import message_to_json
    from mlflow.utils.rest_utils import http_request, verify_rest_response

    endpoint = "/api/2.0/mlflow/runs/log-batch"
    creds = _host_creds(uri)
    for start in range(0, len(metrics), _PER_REQUEST):
        chunk = metrics[start : start + _PER_REQUEST]
        body = message_to_json(LogBatch(run_id=run_id, metrics=[m.to_proto() for m in chunk]))
        response = http_request(
            creds,
            endpoint,
            "POST",
            json=json.loads(body),
            max_retries=REQUEST_RETRIES,
            backoff_factor=_BACKOFF,
            timeout=REQUEST_TIMEOUT,
        )
        verify_rest_response(response, endpoint)


@contextlib.contextmanager
def bounded_requests(uri: str) -> Iterator[None]:
    """Give MLflow calls made inside the bounded retry policy (HTTP stores only).

    MLflow reads these settings from the environment at each request, so they
    are set for the duration of the block and restored after it; a value the
    user set is left as it is.
    """
    if not is_http(uri):
        yield
        return
    policy = {
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(REQUEST_RETRIES),
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": str(_BACKOFF),
        "MLFLOW_HTTP_REQUEST_TIMEOUT": str(REQUEST_TIMEOUT),
    }
    with _ENV_LOCK:
        added = [name for name in policy if name not in os.environ]
        for name in added:
            os.environ[name] = policy[name]
        try:
            yield
        finally:
            for name in added:
                os.environ.pop(name, None)
