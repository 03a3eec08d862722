"""``python -m nbtools doctor``: can training run on this machine, and what to fix if not.

A tour: :mod:`._machine` checks torch, CUDA and NCCL, the GPUs NVML reports, the
shared-memory filesystem of the memory tier (``NBTOOLS_SNAPSHOT_DIR`` or ``/dev/shm``),
open-file limits, the forkserver and the ``NBTOOLS_*`` variables set (against the table in
:mod:`nbtools._internal.settings`); :mod:`._storage` checks the
dataset cache and checkpoint staging directories and the MLflow store; :mod:`._launch`
checks Ray's head when ``RAY_ADDRESS`` is set and runs a 2-rank smoke launch;
:mod:`._report` holds each :class:`Finding` and prints them. Start reading at :func:`run`: the
report starts with the nbtools, Python and torch versions, and each check's line is printed as
soon as it finishes.

Only what stops training fails (exit status 1): the smoke launch, a cache or staging
directory that cannot be written, a ``RAY_ADDRESS`` that cannot be reached, an ``NBTOOLS_*``
variable whose value nbtools refuses. No GPU, a small
``/dev/shm``, low limits, no MLflow or a smoke launch slower than ``SMOKE_SLOW_S`` (10 s,
with the load average) are warnings. Nothing is written into the working
directory.

Example:
    >>> from nbtools._doctor import Status, run_checks
    >>> [f.name for f in run_checks(smoke=False)][:2]  # doctest: +SKIP
    ['torch', 'gpus']
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable

from nbtools._doctor._launch import SMOKE_SLOW_S, check_ray, check_smoke
from nbtools._doctor._machine import (
    check_forkserver,
    check_gpus,
    check_nofile,
    check_settings,
    check_shm,
    check_torch,
)
from nbtools._doctor._report import (
    Finding,
    Status,
    exit_status,
    finding_lines,
    header,
    to_json,
    verdict,
)
from nbtools._doctor._storage import check_cache, check_mlflow, check_staging

__all__ = ["Finding", "SMOKE_SLOW_S", "Status", "header", "run", "run_checks"]


def run_checks(
    *,
    smoke: bool = True,
    shm_path: str | None = None,
    on_finding: Callable[[Finding], None] | None = None,
) -> list[Finding]:
    """Every check, in the order they are shown.

    Args:
        smoke: Run the 2-rank smoke launch (seconds; the rest takes well under a second
            apart from importing torch).
        shm_path: The shared-memory filesystem (default: where the memory tier keeps its
            snapshots, ``$NBTOOLS_SNAPSHOT_DIR`` or ``/dev/shm``).
        on_finding: Called with each finding as soon as its check finishes.
    """
    checks: list[Callable[[], Finding]] = [
        check_torch,
        check_gpus,
        lambda: check_shm(shm_path),
        check_nofile,
        check_forkserver,
        check_cache,
        check_staging,
        check_mlflow,
        check_ray,
        check_settings,
    ]
    if smoke:
        checks.append(check_smoke)
    findings = []
    for check in checks:
        findings.append(check())
        if on_finding is not None:
            on_finding(findings[-1])
    return findings


def _print_now(finding: Finding) -> None:
    sys.stdout.write("\n".join(finding_lines(finding)) + "\n")
    sys.stdout.flush()


def run(*, as_json: bool = False, smoke: bool = True, shm_path: str | None = None) -> int:
    """Run the checks, print the report, return the exit status (0, or 1 when one failed).

    The text report starts with the versions and prints each check's line as it finishes.
    With ``as_json``, stdout carries one JSON object and nothing else: whatever the checks
    print meanwhile goes to stderr.
    """
    if as_json:
        with contextlib.redirect_stdout(sys.stderr):
            findings = run_checks(smoke=smoke, shm_path=shm_path)
        sys.stdout.write(to_json(findings) + "\n")
    else:
        sys.stdout.write(header() + "\n")
        sys.stdout.flush()
        findings = run_checks(smoke=smoke, shm_path=shm_path, on_finding=_print_now)
        sys.stdout.write("\n" + verdict(findings) + "\n")
    sys.stdout.flush()
    return exit_status(findings)
