"""Shared fixtures. Every test is checked for leaks (autouse):

- child processes still alive after the test (after a short grace period);
- new non-daemon or nbtools threads still alive;
- environment variables added, changed or removed;
- an initialised ``torch.distributed`` default group;
- files left in the temporary directory (each pytest process gets its own
  ``TMPDIR``, so parallel workers do not see each other's files);
- new ``/dev/shm`` entries (checked once for the whole session).

A leak fails the test even when its assertions passed, and the leaked thing is
cleaned up so that the next test starts clean.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import psutil
import pytest
from _leaks import env_problems, process_group_problems

# MLflow's telemetry thread sets and clears an environment variable of its own.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
# A Ray node can take longer than Ray's default wait to register on a busy 2-core machine
# (tests run 2 at a time); notebook kernels inherit this, so notebook 06's cluster does too.
os.environ.setdefault("RAY_raylet_start_wait_time_s", "240")

# Long-lived helpers of the standard library that are owned by the interpreter,
# not by a test: multiprocessing's resource tracker and forkserver.
_ALLOWED_CHILD_MARKERS = (
    "multiprocessing.resource_tracker",
    "multiprocessing.forkserver",
)
_ALLOWED_THREAD_PREFIXES = (
    "pytest_timeout",
    "ThreadPoolExecutor-",  # interpreter-wide executors are joined at exit; nbtools names its own
    "asyncio_",
    "IPythonHistorySavingThread",
    "Dummy-",
    "QueueFeederThread",
)
_IGNORED_ENV = {
    "PYTEST_CURRENT_TEST",
    "TMPDIR",
    "TEMP",
    "TMP",
    "COLUMNS",
    "LINES",
    "KMP_INIT_AT_FORK",
}
_SESSION_TMP: str | None = None
#: How long a test's child processes may take to exit before they count as leaked
#: (the leak checks' own tests, which leak on purpose, shorten it).
_PROCESS_GRACE_S = float(os.environ.get("NBTOOLS_TESTS_PROCESS_GRACE_S", "10"))
_SHM_BEFORE: set[str] = set()


#: The notebook that runs on the Ray tests' cluster (``RAY_ADDRESS``, set by the
#: project's root ``conftest.py``) instead of its own.
_RAY_NOTEBOOK = "notebooks/06_multinode_ray.ipynb"
#: A test that starts the Ray cluster may spend several tries on it (``ray/_ray_cluster.py``).
_RAY_TIMEOUT_S = 600


def _uses_ray_cluster(item: pytest.Item) -> bool:
    path = item.nodeid.split("::", 1)[0]
    return path.startswith("tests/ray/") or path == _RAY_NOTEBOOK


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep each test file on one worker: its module fixtures start servers, kernels, ranks
    and Ray clusters once, not once per worker. Everything that uses a Ray cluster is one
    group, so one cluster serves them all and no two start at once."""
    for item in items:
        if _uses_ray_cluster(item):
            item.add_marker(pytest.mark.xdist_group("ray"))
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(_RAY_TIMEOUT_S))
        else:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))


def _shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def pytest_configure(config: pytest.Config) -> None:
    """Give this pytest process a private temporary directory."""
    global _SESSION_TMP, _SHM_BEFORE
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    # Workers make their directories beside the controller's, not inside it: nested
    # paths grow past the 107 bytes a Unix socket path may have (Ray, forkservers).
    base = os.environ.setdefault("NBTOOLS_TESTS_TMP_BASE", tempfile.gettempdir())
    _SESSION_TMP = tempfile.mkdtemp(prefix=f"nbtools-tests-{worker}-", dir=base)
    os.environ["TMPDIR"] = _SESSION_TMP
    tempfile.tempdir = None  # re-read TMPDIR
    # torch's first compiled/optimizer use sets this and creates the directory once.
    inductor = os.path.join(_SESSION_TMP, "torchinductor")
    os.makedirs(inductor, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor)
    _SHM_BEFORE = _shm_entries()


def pytest_unconfigure(config: pytest.Config) -> None:
    if _SESSION_TMP:
        # multiprocessing removes its own pymp-* directory (forkserver socket) in an
        # exit finalizer of priority -100; remove the session directory after it.
        from multiprocessing.util import Finalize

        Finalize(
            None,
            shutil.rmtree,
            args=(_SESSION_TMP,),
            kwargs={"ignore_errors": True},
            exitpriority=-200,
        )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # the controller checks /dev/shm once for everyone
    time.sleep(0.2)
    leaked = sorted(e for e in _shm_entries() - _SHM_BEFORE if not e.startswith("sem."))
    if leaked:
        session.exitstatus = 1
        sys.stderr.write(f"\nLEAK: /dev/shm entries left behind by the test session: {leaked}\n")


def _is_allowed_child(proc: psutil.Process) -> bool:
    try:
        cmdline = " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return True
    return any(marker in cmdline for marker in _ALLOWED_CHILD_MARKERS)


def _children() -> dict[int, psutil.Process]:
    out = {}
    for proc in psutil.Process().children(recursive=True):
        if not _is_allowed_child(proc):
            out[proc.pid] = proc
    return out


def _threads() -> dict[int, threading.Thread]:
    return {t.ident or id(t): t for t in threading.enumerate()}


def _tmp_entries() -> set[str]:
    root = tempfile.gettempdir()
    try:
        return set(os.listdir(root))
    except OSError:
        return set()


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest):
    """Fail the test if it leaks processes, threads, env vars, a process group or temp files."""
    env_before = dict(os.environ)
    threads_before = set(_threads())
    children_before = set(_children())
    tmp_before = _tmp_entries()
    yield
    problems: list[str] = []

    # Processes: allow a grace period for exiting ranks and workers.
    deadline = time.monotonic() + _PROCESS_GRACE_S
    leaked = {p: c for p, c in _children().items() if p not in children_before}
    while leaked and time.monotonic() < deadline:
        time.sleep(0.1)
        leaked = {p: c for p, c in _children().items() if p not in children_before}
    if leaked:
        desc = []
        for proc in leaked.values():
            try:
                desc.append(f"{proc.pid}: {' '.join(proc.cmdline())[:200]}")
                proc.kill()
            except psutil.Error:
                pass
        problems.append("child processes left running: " + "; ".join(desc))

    # Threads: give finishing threads a moment too.
    deadline = time.monotonic() + 2

    def new_threads():
        return [
            t
            for k, t in _threads().items()
            if k not in threads_before
            and t.is_alive()
            and not t.name.startswith(_ALLOWED_THREAD_PREFIXES)
            and (not t.daemon or t.name.startswith("nbtools"))
        ]

    extra = new_threads()
    while extra and time.monotonic() < deadline:
        time.sleep(0.05)
        extra = new_threads()
    if extra:
        problems.append("threads left running: " + ", ".join(sorted(t.name for t in extra)))

    problems += env_problems(env_before, _IGNORED_ENV)
    problems += process_group_problems()

    # Temporary files.
    new_tmp = sorted(
        e for e in _tmp_entries() - tmp_before if not e.startswith(("pytest-", "pymp-"))
    )
    if new_tmp:
        problems.append(f"temporary files left in {tempfile.gettempdir()}: {new_tmp[:10]}")
        for entry in new_tmp:
            path = os.path.join(tempfile.gettempdir(), entry)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.unlink(path)
                except OSError:
                    pass

    if problems:
        pytest.fail(
            "LEAK in " + request.node.nodeid + ":\n  " + "\n  ".join(problems), pytrace=False
        )


def cuda_available() -> bool:
    """True when torch sees at least one CUDA device."""
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


@pytest.fixture
def sigint_default():
    """SIGINT raises ``KeyboardInterrupt`` during the test, as in a kernel, then is restored.

    For tests that send SIGINT: a session started with SIGINT ignored
    (``nohup pytest ... &``) would otherwise never see it.
    """
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    if before is not None:
        signal.signal(signal.SIGINT, before)


@pytest.fixture
def clean_bus():
    """The kernel's event bus (``nbtools.events.bus()``) empty before and after the test."""
    from nbtools import events

    events.bus().clear()
    yield
    events.bus().clear()


@pytest.fixture
def mount_tmpfs(tmp_path):
    """Mount small tmpfs filesystems for the test (root only); unmounted afterwards.

    Call it with a size such as ``"50m"``; it returns the mount point. Skips the
    test, with the reason, where mounting is not possible.
    """
    mounts = []

    def mount(size: str):
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        mnt = tmp_path / f"tmpfs-{len(mounts)}"
        mnt.mkdir()
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        mounts.append(mnt)
        return mnt

    yield mount
    for mnt in mounts:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


requires_gpu = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")
requires_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


@pytest.fixture(scope="session")
def mlflow_store(tmp_path_factory: pytest.TempPathFactory):
    """Make new MLflow sqlite stores: ``mlflow_store(path)`` returns the ``sqlite:///`` URI.

    Creating a store runs MLflow's migrations (seconds; tens of seconds on a busy machine);
    they run once per test process, into a template, and each store is a copy of it: the
    same tables and Default experiment a fresh store has. For tests whose store is only
    where their runs go, not for those about creating one.
    """
    template: list[str] = []

    def new(path: os.PathLike[str] | str) -> str:
        if not template:
            from mlflow import MlflowClient

            made = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
            MlflowClient(tracking_uri=f"sqlite:///{made}").search_experiments()
            template.append(str(made))
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        shutil.copyfile(template[0], path)
        return f"sqlite:///{path}"

    return new


@pytest.fixture(scope="session")
def _shell():
    """One IPython shell for the session (magics and pool tests), as a notebook kernel has."""
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    if InteractiveShell.initialized():
        return InteractiveShell.instance()
    # The shell replaces a few interpreter hooks; give them back, as IPython's own
    # test harness does, so that pytest keeps reporting normally.
    saved = sys.displayhook, sys.excepthook, sys.modules.get("__main__")
    config = Config()
    config.HistoryManager.hist_file = ":memory:"  # no file, no history thread
    shell = InteractiveShell.instance(config=config)
    sys.displayhook, sys.excepthook = saved[0], saved[1]
    if saved[2] is not None:
        sys.modules["__main__"] = saved[2]
    return shell
