"""Checks that start something: Ray's reachability and a 2-rank smoke launch.

Both are bounded in time. The Ray check opens one TCP connection to the address
``RAY_ADDRESS`` names (Ray's own ``ray.init`` may wait for minutes); the smoke launch runs
``@distributed(processes=2)`` with one all-reduce in a child process that is killed with its
process group when it does not finish in time. The child works in a temporary directory of
its own, so nothing lands in the working directory.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any
from urllib.parse import urlsplit

from nbtools._doctor._report import Finding, Status

__all__ = [
    "RAY_TIMEOUT_S",
    "SMOKE_SLOW_S",
    "SMOKE_TIMEOUT_S",
    "check_ray",
    "check_smoke",
    "ray_endpoint",
    "smoke",
    "smoke_finding",
]

#: Seconds the Ray check waits for a TCP connection.
RAY_TIMEOUT_S = 5.0
#: Seconds the smoke launch may take (a first launch imports torch in a forkserver).
SMOKE_TIMEOUT_S = 180.0
#: A smoke launch slower than this is a warning: on an idle machine two CPU ranks start,
#: all-reduce and exit in a few seconds, so a slower one says the machine is busy (the
#: warning gives the load average) or a rendezvous waits on something.
SMOKE_SLOW_S = 10.0
_RAY_DEFAULT_PORT = 6379
_RAY_CLIENT_PORT = 10001
_MARKER = "NBTOOLS-DOCTOR-SMOKE "


def ray_endpoint(address: str) -> tuple[str, int] | None:
    """The host and port that ``RAY_ADDRESS`` names; None for ``auto`` with no local cluster."""
    address = address.strip()
    if address in ("auto", "local"):
        current = os.path.join(tempfile.gettempdir(), "ray", "ray_current_cluster")
        for candidate in (current, "/tmp/ray/ray_current_cluster"):
            try:
                with open(candidate) as fh:
                    address = fh.read().strip()
                break
            except OSError:
                continue
        else:
            return None
    if "://" in address:
        parts = urlsplit(address)
        default = _RAY_CLIENT_PORT if parts.scheme == "ray" else _RAY_DEFAULT_PORT
        return parts.hostname or "127.0.0.1", parts.port or default
    host, _, port = address.rpartition(":")
    if not host:
        return address, _RAY_DEFAULT_PORT
    return host.strip("[]"), int(port)


def check_ray() -> Finding:
    """When ``RAY_ADDRESS`` is set, whether its head answers; skipped otherwise."""
    address = os.environ.get("RAY_ADDRESS", "").strip()
    if not address:
        return Finding("ray", Status.SKIP, "RAY_ADDRESS is not set (local ranks only)")
    details: dict[str, Any] = {"address": address}
    # Not imported: importing ray changes the environment (RAY_CLIENT_MODE) and takes seconds.
    try:
        details["ray"] = importlib.metadata.version("ray")
    except importlib.metadata.PackageNotFoundError:
        return Finding(
            "ray",
            Status.FAIL,
            f"RAY_ADDRESS={address} is set but Ray is not installed",
            'pip install "nbtools-train[ray]", or unset RAY_ADDRESS',
            details,
        )
    try:
        endpoint = ray_endpoint(address)
    except ValueError:
        return Finding(
            "ray",
            Status.FAIL,
            f"RAY_ADDRESS={address!r} is not an address",
            "set it to HOST:PORT of the head node (e.g. 10.0.0.1:6379) or ray://HOST:10001",
            details,
        )
    if endpoint is None:
        return Finding(
            "ray",
            Status.FAIL,
            f"RAY_ADDRESS={address} but no Ray cluster runs here",
            "start one (ray start --head) or set RAY_ADDRESS to the head's HOST:PORT",
            details,
        )
    host, port = endpoint
    details.update(host=host, port=port)
    start = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=RAY_TIMEOUT_S):
            pass
    except OSError as exc:
        return Finding(
            "ray",
            Status.FAIL,
            f"the Ray head at {host}:{port} (RAY_ADDRESS={address}) does not answer: "
            f"{exc.strerror or exc}",
            "check that the cluster runs (ray status on the head) and that this "
            "machine can reach that port, or unset RAY_ADDRESS",
            details,
        )
    details["seconds"] = round(time.monotonic() - start, 3)
    return Finding(
        "ray", Status.OK, f"Ray {details['ray']}: the head at {host}:{port} answers", "", details
    )


def smoke() -> dict[str, Any]:
    """Run ``@distributed(processes=2)`` with one all-reduce; what each rank returned."""
    from nbtools import distributed

    def all_reduce() -> float:
        import torch
        import torch.distributed as dist

        value = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(value)
        return float(value.item())

    start = time.monotonic()
    results = distributed(processes=2, output="none")(all_reduce).distributed()
    return {"results": results, "seconds": round(time.monotonic() - start, 3)}


def check_smoke(timeout: float = SMOKE_TIMEOUT_S) -> Finding:
    """Launch two CPU ranks (gloo) that all-reduce one tensor, in a child process."""
    with tempfile.TemporaryDirectory(prefix="nbtools-doctor-") as work:
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "nbtools._doctor._launch"],
                cwd=work,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        except OSError as exc:
            return Finding(
                "smoke launch",
                Status.FAIL,
                f"cannot start Python: {exc}",
                "check the interpreter and the temp dir",
            )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return Finding(
                "smoke launch",
                Status.FAIL,
                f"2 CPU ranks did not finish one all-reduce within {timeout:.0f} s",
                "a firewall or a wrong hostname can stop the rendezvous on 127.0.0.1; "
                "run python -m nbtools demo to see the ranks' output",
            )
    line = next((ln for ln in out.splitlines() if ln.startswith(_MARKER)), None)
    if proc.returncode != 0 or line is None:
        tail = (err or out).strip().splitlines()[-6:]
        return Finding(
            "smoke launch",
            Status.FAIL,
            f"2 CPU ranks failed (exit status {proc.returncode}): {' | '.join(tail)[-500:]}",
            "fix the error above; python -m nbtools demo shows the ranks' full output",
            {"stderr": err[-4000:]},
        )
    return smoke_finding(json.loads(line[len(_MARKER) :]))


def smoke_finding(report: dict[str, Any]) -> Finding:
    """What a finished smoke launch says: its sum, and a warning when it was slow.

    Args:
        report: What the launch printed: ``results`` (each rank's sum) and ``seconds``.
    """
    if report["results"] != [3.0, 3.0]:
        return Finding(
            "smoke launch",
            Status.FAIL,
            f"2 CPU ranks returned {report['results']}, not the all-reduce [3.0, 3.0]",
            "gloo gave a wrong sum: check the torch installation",
            report,
        )
    summary = f"2 CPU ranks (gloo) all-reduced one tensor in {report['seconds']:.1f} s"
    if round(report["seconds"], 1) <= SMOKE_SLOW_S:  # as the line says it: 10.0 s is not slower
        return Finding("smoke launch", Status.OK, summary, "", report)
    load = os.getloadavg()
    cpus = os.cpu_count() or 1
    report = {**report, "load_average": [round(v, 2) for v in load], "cpus": cpus}
    return Finding(
        "smoke launch",
        Status.WARN,
        f"{summary}: slower than {SMOKE_SLOW_S:.0f} s, with a load average of "
        f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min) on {cpus} CPUs",
        "a first launch starts Python and imports torch in each rank; on a busy machine "
        "(a load above its CPUs) that takes longer: run the doctor again when the load "
        "falls, or find what keeps the CPUs busy (top)",
        report,
    )


if __name__ == "__main__":
    print(_MARKER + json.dumps(smoke()), flush=True)
