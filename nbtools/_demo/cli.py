"""``python -m nbtools demo``: train on 2 CPU ranks, kill one, recover, compare with an uninterrupted run.

The demo first trains one epoch and throws it away, so that both runs start warm, then runs
the killed-and-recovered training, then the uninterrupted one. It prints the recovery as
the run's events measured it (from the kill to the next step, the steps trained again, where
the state came from) and both wall times.

Layout of the output directory::

    OUT/volume/                 the sample files (the "slow volume")
    OUT/cache/                  their local cached copies
    OUT/mlflow.db               MLflow store (both runs, experiment "nbtools-demo")
    OUT/recovered/checkpoints/  step_<N>/ checkpoints of the killed-and-recovered run
    OUT/recovered/records/      per-rank JSONL: sample ids consumed at every step
    OUT/uninterrupted/...       the same for the reference run
    OUT/warm-up/...             the warm-up epoch (MLflow experiment "nbtools-demo-warm-up")
    OUT/recovery.html           the recovered loss curve over the uninterrupted one
    OUT/timeline.html           the GPU pane's timeline of the warm-up and both runs, each
                                labelled: GPUs (when there are any), checkpoint saves, the
                                kill, the restart, the restore, each rank's step rate
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Any

from nbtools import events
from nbtools._demo.history import (
    Recovery,
    continuity_problems,
    effective_history,
    exactly_once_problems,
    loss_curve,
    prepare_experiment,
    recovery_from_events,
)
from nbtools._demo.samples import make_volume
from nbtools._demo.training import DemoConfig, train
from nbtools.errors import DistributedError

__all__ = ["DemoOutcome", "run_pair", "report", "run_demo"]

_MARKER = ".nbtools-demo"
_RUN_DIRS = ("warm-up", "recovered", "uninterrupted")
#: The MLflow experiment of the warm-up's one epoch (kept apart from the two runs).
_WARM_UP_EXPERIMENT = "nbtools-demo-warm-up"


@dataclass
class DemoOutcome:
    """Both runs' configurations and the per-rank results ``train`` returned."""

    recovered: DemoConfig
    reference: DemoConfig
    recovered_results: list[dict[str, Any]]
    reference_results: list[dict[str, Any]]
    samples: int
    recovered_seconds: float
    reference_seconds: float
    recovery: Recovery | None = None
    warmup_seconds: float | None = None

    @property
    def world_size(self) -> int:
        return len(self.recovered_results)

    @property
    def steps(self) -> int:
        return self.recovered_results[0]["steps"]


def _claim(out: str) -> None:
    """Make ``out`` the demo's directory; clear what an earlier demo run left in it."""
    marker = os.path.join(out, _MARKER)
    if os.path.isdir(out) and os.listdir(out) and not os.path.exists(marker):
        raise FileExistsError(
            f"{out} exists and was not made by the demo; pass another --out, or empty it"
        )
    os.makedirs(out, exist_ok=True)
    with open(marker, "w") as fh:
        fh.write("made by python -m nbtools demo; safe to delete\n")
    # A fresh start: old checkpoints would make the recovered run resume at its end.
    for name in (
        "volume",
        "cache",
        *_RUN_DIRS,
        "mlflow.db",
        "mlartifacts",
        "recovery.html",
        "timeline.html",
    ):
        path = os.path.join(out, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)


def run_pair(
    out: str,
    *,
    samples: int = 128,
    epochs: int = 3,
    kill_at: int = 13,
    launch: dict[str, Any] | None = None,
    verbose: bool = True,
    warm: bool = False,
) -> DemoOutcome:
    """Run the killed-and-recovered training and the uninterrupted one under ``out``.

    Each run begins with a ``phase`` event naming it (the timeline labels the runs), and
    the recovery's figures come from the events of the killed run (:class:`Recovery`).

    Args:
        out: Output directory (created; an earlier demo's results in it are replaced).
        samples: Sample files on the volume.
        epochs: Passes over the data.
        kill_at: Rank 1 SIGKILLs itself after this step on the first attempt.
        launch: ``@distributed`` options (default ``processes=2``).
        verbose: Stream the ranks' progress lines.
        warm: Start with one epoch trained as the runs train, thrown away (``warm-up/``,
            its own MLflow experiment), so that neither run pays for a cold start (the
            ranks' imports, the volume's cache, MLflow's store) and their wall times
            compare fairly.
    """
    from nbtools.launch import distributed

    out = os.path.abspath(out)
    _claim(out)
    make_volume(os.path.join(out, "volume"), samples)
    uri = "sqlite:///" + os.path.join(out, "mlflow.db")
    base = DemoConfig(
        volume=os.path.join(out, "volume"),
        run_dir="",
        cache_dir=os.path.join(out, "cache"),
        tracking_uri=uri,
        epochs=epochs,
        verbose=verbose,
        use_cuda=bool(launch and launch.get("gpus")),
    )
    prepare_experiment(uri, base.experiment, os.path.join(out, "mlartifacts"))
    recovered = base.replace(
        run_dir=os.path.join(out, "recovered"), run_name="recovered", kill_at=kill_at
    )
    reference = base.replace(
        run_dir=os.path.join(out, "uninterrupted"), run_name="uninterrupted", kill_at=None
    )
    options = dict(launch or {"processes": 2})
    output = "all" if verbose else "none"
    warmup = None
    if warm:
        # One epoch as the runs train it, thrown away: ranks, imports, the volume's cache
        # and MLflow are warm for both runs.
        prepare_experiment(uri, _WARM_UP_EXPERIMENT, os.path.join(out, "mlartifacts"))
        events.emit("phase", "warm-up: one epoch, discarded")
        began = time.perf_counter()
        warm_up = base.replace(
            run_dir=os.path.join(out, "warm-up"),
            run_name="warm-up",
            experiment=_WARM_UP_EXPERIMENT,
            epochs=1,
            kill_at=None,
            verbose=False,
        )
        distributed(**options, output="none")(train).distributed(warm_up)
        warmup = time.perf_counter() - began
    events.emit("phase", "run 1: killed and recovered")
    since = time.time()
    started = time.perf_counter()
    recovered_results = distributed(**options, max_restarts=2, output=output)(train).distributed(
        recovered
    )
    middle = time.perf_counter()
    recovery = recovery_from_events(events.log(since=since))
    events.emit("phase", "run 2: uninterrupted")
    reference_results = distributed(**options, output=output)(train).distributed(reference)
    return DemoOutcome(
        recovered,
        reference,
        recovered_results,
        reference_results,
        samples,
        recovered_seconds=middle - started,
        reference_seconds=time.perf_counter() - middle,
        recovery=recovery,
        warmup_seconds=warmup,
    )


def _params_problems(outcome: DemoOutcome) -> list[str]:
    import torch

    ours = outcome.recovered_results[0]["params"]
    theirs = outcome.reference_results[0]["params"]
    differ = [name for name in theirs if not torch.equal(ours[name], theirs[name])]
    if differ:
        return [f"final parameters differ from the uninterrupted run's: {', '.join(differ)}"]
    return []


def report(outcome: DemoOutcome, html: str | None = None) -> list[str]:
    """Check the recovered run against the reference; write the figure to ``html``.

    Returns:
        The problems found (empty when the recovered run equals the uninterrupted one).
    """
    cfg = outcome.recovered
    problems = _params_problems(outcome)
    history = effective_history(cfg.records)
    problems += exactly_once_problems(history, outcome.samples, outcome.steps, outcome.world_size)
    problems += continuity_problems(cfg.tracking_uri, cfg.experiment, cfg.run_name, outcome.steps)
    if html is not None:
        from nbtools._demo.figure import recovery_figure

        fig = recovery_figure(
            loss_curve(cfg.tracking_uri, outcome.reference_results[0]["run_id"]),
            loss_curve(cfg.tracking_uri, outcome.recovered_results[0]["run_id"]),
            killed_at=cfg.kill_at,
            restored_step=outcome.recovered_results[0]["restored_step"],
            restored_tier=outcome.recovered_results[0].get("restored_tier"),
        )
        fig.write_html(html, include_plotlyjs=True)  # offline: no CDN needed to open it
    return problems


def _open_pane() -> Any:
    """A GPU pane (not shown) that watches the runs: this machine's GPUs and the run's events."""
    try:
        from nbtools.monitor import GPUPane
    except ImportError:  # the notebook extra is not installed: no timeline
        return None
    return GPUPane(interval=2.0, idle_timeout=None, display=False)


def _close_pane(pane: Any, path: str) -> str | None:
    """Write the pane's timeline to ``path`` and close it; the path, or None without a pane."""
    if pane is None:
        return None
    try:
        if not os.path.exists(os.path.join(os.path.dirname(path), _MARKER)):
            return None  # the demo refused the directory: write nothing into it
        return pane.to_html(path)
    finally:
        pane.close()


def run_demo(out: str = "nbtools-demo") -> int:
    """Run the demo into ``out``; 0 when the recovered run equals the uninterrupted one."""
    out = os.path.abspath(out)
    print(
        f"nbtools demo: 2 CPU ranks; rank 1 is killed mid-run and the group recovers. Output: {out}"
    )
    print(
        "First one warm-up epoch, thrown away, so that neither run pays the cold start; "
        "then the killed run; then an uninterrupted one to compare with."
    )
    pane = _open_pane()
    try:
        outcome = run_pair(out, warm=True)
    except FileExistsError as exc:
        print(f"nbtools demo: {exc}", file=sys.stderr)
        return 2
    except DistributedError as exc:
        print(f"nbtools demo: FAILED: the run did not recover: {exc}", file=sys.stderr)
        return 1
    finally:
        timeline = _close_pane(pane, os.path.join(out, "timeline.html"))
    html = os.path.join(out, "recovery.html")
    problems = report(outcome, html)
    first = outcome.recovered_results[0]
    print()
    if outcome.recovery is not None:
        print(outcome.recovery.line())
    print(
        f"restarts:      {first['restart']} (restored step {first['restored_step']} "
        f"from {first['restored_tier']})"
    )
    print(
        f"wall time:     {outcome.recovered_seconds:.1f} s killed and recovered, "
        f"{outcome.reference_seconds:.1f} s uninterrupted (both after a "
        f"{outcome.warmup_seconds or 0:.1f} s warm-up epoch: neither pays the cold start)"
    )
    print(f"checkpoints:   {outcome.recovered.checkpoints}")
    print(f"MLflow:        {outcome.recovered.tracking_uri}  run id {first['run_id']}")
    print(f"               (mlflow ui --backend-store-uri {outcome.recovered.tracking_uri})")
    print(f"figure:        {html}")
    if timeline:
        print(f"timeline:      {timeline}  (both runs: saves, the kill, the restart, the restore)")
    if problems:
        print("FAILED: the recovered run differs from the uninterrupted one:", file=sys.stderr)
        for problem in problems:
            print(f"  - {problem}", file=sys.stderr)
        return 1
    print(
        f"OK: final parameters equal the uninterrupted run's (torch.equal), every sample of "
        f"every epoch was seen exactly once, and MLflow holds one run with steps 0..{outcome.steps - 1}"
    )
    return 0
