"""Recovery of HF's and Lightning's Trainer: ``NbtoolsCheckpoint`` vs the Trainer's own checkpoints.

Prints one JSON line per stack. For each stack, two launches of the same training run
on ``--processes`` CPU ranks (``@distributed(max_restarts=1)``, gloo, DDP), each rank
holding about ``--state-mb`` of model and Adam state. Rank 1 SIGKILLs itself after step
``--kill-at``; the launcher restarts the group and the Trainer resumes:

- ``nbtools``: ``callbacks=[NbtoolsCheckpoint(root, every=E, memory_every=M)]`` and a
  plain ``train()`` / ``fit()`` on every attempt;
- ``trainer`` (today's path, the baseline): the Trainer's own checkpoints every ``E``
  steps (HF ``save_steps``; Lightning ``ModelCheckpoint(every_n_train_steps=E,
  save_last=True)``) and, on the restarted attempt, ``resume_from_checkpoint=`` the
  last one (HF) / ``ckpt_path=`` the newest one (Lightning).

The default setup is the one recovery from memory is judged by: 4 ranks, 252 MB of
state per rank, ``every=200``, ``memory_every=10``, a kill after step 257 (57 steps
after the last volume checkpoint: fewer than the ``every / 2`` a kill at a random
step costs on average, which favours the Trainer's own checkpoints), and both paths'
checkpoints on one volume: an S3-compatible server on loopback (moto behind
``benchmarks/_capped_s3.py``) that serves at most ``--mbps`` (100 MB/s). Lightning's
``ModelCheckpoint`` writes to and its ``ckpt_path`` reads from the ``s3://`` URL
itself (every rank reads the checkpoint); HF's ``Trainer`` saves to a local
``output_dir`` only, so its checkpoints are uploaded to the volume as each is saved
and the restarted attempt downloads the newest one (once per node) before
``resume_from_checkpoint=``, as a job whose local disk went with its node does. The
two stacks' four launches took 16 minutes on 2 cores shared with other work.

``--quick``: a short look (2 ranks, 48 MB, ``every=50``, a kill after step 87, the
volumes in local directories).

Before the first case the forkserver is started and its preloads imported, so that
every path's ranks start forked from it. Figures, per path:

- ``kill_to_first_step_s``: from the kill to the first step the restarted attempt
  completes (rank 0);
- ``kill_to_progress_s``: from the kill to the completion of step ``kill_at + 1``,
  the first step the killed attempt never made: what the failure cost in time;
- ``kill_to_function_s``: from the kill to the restarted rank 0 running the training
  function (detecting the failure, stopping the survivors, starting the ranks: the
  launcher's part, the same for both paths); ``function_to_progress_s`` the rest,
  split into ``imports_s`` (the restarted rank importing the Trainer's library: the
  driver imports the stack's library before the first launch, as a notebook's cells do,
  so the launcher's forkserver preloads it) and
  ``after_imports_to_progress_s`` (building the Trainer, its restore, the steps
  trained again: the part a checkpointing path decides);
- ``timeline_s``: from the kill to each mark of the restarted attempt, in order:
  ``function`` (rank 0 runs the training function), ``imported`` (the stack's library),
  ``trainer_built``, Lightning's ``setup`` and ``fit_start`` / HF's ``train_begin``
  (before any restore), ``restored`` (the callbacks' start hooks done: nbtools's
  restore; Lightning loads its ``ckpt_path`` between ``setup`` and ``fit_start``, HF its
  checkpoint before ``train_begin``), ``train_start`` and the first batch or step begun;
- ``steps_trained_again``: ``kill_at`` minus the step the restarted attempt resumed after;
- ``volume_bytes_read``: object bytes the capped volume sent from the kill to the
  completion of step ``kill_at + 1`` (None with local directories);
- ``..._x``: nbtools / trainer (goal <= 0.3x for ``kill_to_progress_s``).

    python benchmarks/recovery_trainers.py [--stack hf|lightning|both] [--quick]
        [--state-mb 252] [--every 200] [--memory-every 10] [--kill-at 257]
        [--processes 4] [--mbps 100]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import signal
import sys
import tempfile
import time
from typing import Any

import torch

from nbtools import distributed, runtime

HIDDEN = 1024
_HERE = os.path.dirname(os.path.abspath(__file__))
_TESTS = os.path.join(_HERE, "..", "tests", "checkpoint")
BUCKET = "bench"
#: The steps trained after ``kill_at + 1`` by the restarted attempt.
_AFTER = 2
#: The setups: the one the goals are set for, and a short look.
SETUPS = {
    "issue": {"processes": 4, "state_mb": 252, "every": 200, "memory_every": 10, "kill_at": 257},
    "quick": {"processes": 2, "state_mb": 48, "every": 50, "memory_every": 10, "kill_at": 87},
}


def _layers(state_mb: int) -> int:
    # Parameters plus Adam's two moments: 12 bytes per parameter.
    return max(1, round(state_mb * 1e6 / 12 / (HIDDEN * HIDDEN)))


def _served(cfg: dict[str, Any]) -> int | None:
    """Object bytes the capped volume has sent (None: the volume is a local directory)."""
    if not cfg["endpoint"]:
        return None
    sys.path.insert(0, _TESTS)
    from _restore_servers import s3_served

    return int(s3_served(cfg["endpoint"]))


def _kill_if_due(cfg: dict[str, Any], step: int, kill_file: str, served: dict[str, Any]) -> None:
    """Kill rank 1 at ``kill_at`` on the first attempt; on the restarted one, note in
    ``served`` what the volume had sent when rank 0 completed the step after it (later, a
    final save re-reads what it uploaded to verify it: not a read of the restore)."""
    if step == cfg["kill_at"] + 1 and runtime.get_restart_count() and runtime.get_rank() == 0:
        served.setdefault("at_progress", _served(cfg))
    if runtime.get_restart_count() == 0 and runtime.get_rank() == 1 and step == cfg["kill_at"]:
        served = _served(cfg)  # asked before the kill: no request on the way back
        with open(kill_file, "w") as fh:
            json.dump({"at": time.time(), "served": served}, fh)
        os.kill(os.getpid(), signal.SIGKILL)


def _volume(cfg: dict[str, Any], work: str, name: str) -> str:
    """Where a path keeps its checkpoints: on the capped volume, or in ``work``."""
    return f"s3://{BUCKET}/{os.path.basename(work)}/{name}" if cfg["endpoint"] else f"{work}/{name}"


def _newest(fs: Any, root: str, pattern: str) -> str | None:
    """The entry under ``root`` whose name has the highest step (``pattern``'s group)."""
    try:
        names = fs.ls(root, detail=False, refresh=True)
    except FileNotFoundError:
        return None
    steps = {int(m.group(1)): n for n in names if (m := re.search(pattern, n.rsplit("/", 1)[-1]))}
    return steps[max(steps)] if steps else None


def _hf(cfg: dict[str, Any], path: str, work: str) -> dict[str, Any]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from nbtools.integrations.transformers import NbtoolsCheckpoint

    imported = time.time()

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Sequential(
                *[torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(_layers(cfg["state_mb"]))]
            )

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": (self.body(x).mean(-1) - labels).pow(2).mean()}

    times: dict[int, float] = {}
    marks: dict[str, float] = {}
    served: dict[str, Any] = {}
    resumed: list[int] = []

    class First(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            marks.setdefault("train_begin", time.time())

    class Watch(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            marks.setdefault("restored", time.time())
            resumed.append(int(state.global_step))

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            marks.setdefault("first_step_begin", time.time())

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            times.setdefault(int(state.global_step), time.time())
            _kill_if_due(cfg, int(state.global_step), f"{work}/kill", served)

    class Upload(TrainerCallback):  # type: ignore[misc]
        """The Trainer's checkpoints onto the volume, once each is saved."""

        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            import fsspec
            import torch.distributed as dist

            dist.barrier()  # every rank's files written
            if state.is_world_process_zero:
                name = f"checkpoint-{state.global_step}"
                fs = fsspec.filesystem("s3")
                fs.put(f"{args.output_dir}/{name}", f"{volume}/{name}", recursive=True)
            dist.barrier()

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = [
        {"x": torch.randn(HIDDEN, generator=g), "labels": torch.randn((), generator=g)}
        for _ in range((cfg["kill_at"] + 1 + _AFTER) * cfg["processes"])
    ]
    ours = path == "nbtools"
    volume = _volume(cfg, work, "hf-" + path)
    attempt = runtime.get_restart_count()
    args = TrainingArguments(
        output_dir=f"{work}/hf-{attempt}",
        max_steps=cfg["kill_at"] + 1 + _AFTER,
        per_device_train_batch_size=1,
        report_to=[],
        use_cpu=True,
        logging_strategy="no",
        disable_tqdm=True,
        save_strategy="no" if ours else "steps",
        save_steps=cfg["every"],
    )
    callbacks: list[Any] = [First(), Watch()]
    ckpt = None
    if ours:
        ckpt = NbtoolsCheckpoint(volume, every=cfg["every"], memory_every=cfg["memory_every"])
        callbacks.insert(1, ckpt)
    elif cfg["endpoint"]:
        callbacks.append(Upload())
    trainer = Trainer(model=Net(), args=args, train_dataset=data, callbacks=callbacks)
    last = None if ours or attempt == 0 else _hf_last(cfg, volume, f"{work}/hf-0")
    marks["trainer_built"] = time.time()
    trainer.train(resume_from_checkpoint=last)
    after = ckpt.restored_step if ckpt is not None else resumed[0]
    return {
        "times": times,
        "marks": marks,
        "served": served.get("at_progress"),
        "imported": imported,
        "resumed_after": after or 0,
        "tier": ckpt.restored_tier if ckpt else None,
    }


def _hf_last(cfg: dict[str, Any], volume: str, local: str) -> str | None:
    """The newest of the Trainer's checkpoints: on the volume, downloaded once per node."""
    if not cfg["endpoint"]:
        from transformers.trainer_utils import get_last_checkpoint

        return get_last_checkpoint(local) if os.path.isdir(local) else None
    import fsspec
    import torch.distributed as dist

    fs = fsspec.filesystem("s3")
    newest = _newest(fs, volume, r"^checkpoint-(\d+)$")
    if newest is None:
        return None
    target = f"{local}-restore/{newest.rsplit('/', 1)[-1]}"
    if runtime.get_local_rank() == 0:
        fs.get(newest, target, recursive=True)
    dist.barrier()
    return target


def _lightning(cfg: dict[str, Any], path: str, work: str) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from nbtools.integrations.lightning import NbtoolsCheckpoint

    imported = time.time()

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Sequential(
                *[torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(_layers(cfg["state_mb"]))]
            )

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            x, y = batch
            return (self.body(x).mean(-1) - y).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    times: dict[int, float] = {}
    marks: dict[str, float] = {}
    served: dict[str, Any] = {}

    class First(pl.Callback):  # type: ignore[misc]
        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            marks.setdefault("setup", time.time())

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            marks.setdefault("fit_start", time.time())

    class Watch(pl.Callback):  # type: ignore[misc]
        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            marks.setdefault("restored", time.time())

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            marks.setdefault("train_start", time.time())

        def on_train_batch_start(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
            marks.setdefault("first_batch_start", time.time())

        def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
            times.setdefault(int(trainer.global_step), time.time())
            _kill_if_due(cfg, int(trainer.global_step), f"{work}/kill", served)

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    n = (cfg["kill_at"] + 1 + _AFTER) * cfg["processes"]
    data = torch.utils.data.TensorDataset(
        torch.randn(n, HIDDEN, generator=g), torch.randn(n, generator=g)
    )
    ours = path == "nbtools"
    volume = _volume(cfg, work, "pl-" + path)
    callbacks: list[Any] = [First(), Watch()]
    ckpt = None
    if ours:
        ckpt = NbtoolsCheckpoint(volume, every=cfg["every"], memory_every=cfg["memory_every"])
        callbacks.insert(1, ckpt)
    else:
        callbacks.insert(
            1, ModelCheckpoint(volume, every_n_train_steps=cfg["every"], save_top_k=-1)
        )
    trainer = pl.Trainer(
        max_steps=cfg["kill_at"] + 1 + _AFTER,
        accelerator="cpu",
        devices=cfg["processes"],
        strategy="ddp",
        logger=False,
        enable_checkpointing=not ours,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    resume = None
    if not ours and runtime.get_restart_count() > 0:
        import fsspec

        fs, _ = fsspec.core.url_to_fs(volume)
        newest = _newest(fs, volume, r"step=(\d+)\.ckpt$")
        resume = None if newest is None else fs.unstrip_protocol(newest)
    start = {}

    class Start(pl.Callback):  # type: ignore[misc]
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            start.setdefault("step", int(trainer.global_step))

    trainer.callbacks.append(Start())
    marks["trainer_built"] = time.time()
    trainer.fit(Net(), torch.utils.data.DataLoader(data, batch_size=1), ckpt_path=resume)
    after = ckpt.restored_step if ckpt is not None else start.get("step", 0)
    return {
        "times": times,
        "marks": marks,
        "served": served.get("at_progress"),
        "imported": imported,
        "resumed_after": after or 0,
        "tier": ckpt.restored_tier if ckpt else None,
    }


def _run(stack: str, path: str, cfg: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="recovery-trainers-") as work:

        @distributed(
            processes=cfg["processes"],
            max_restarts=1,
            output="none",
        )
        def train() -> dict[str, Any]:
            started = time.time()
            fn = _hf if stack == "hf" else _lightning
            out = fn(cfg, path, work)
            out["started"] = started
            out["restart"] = runtime.get_restart_count()
            return out

        got = train.distributed()[0]
        with open(f"{work}/kill") as fh:
            kill = json.load(fh)
    killed, served = kill["at"], got["served"]
    assert got["restart"] == 1, got
    times = {int(k): v for k, v in got["times"].items()}
    return {
        "kill_to_function_s": round(got["started"] - killed, 3),
        "kill_to_first_step_s": round(min(times.values()) - killed, 3),
        "kill_to_progress_s": round(times[cfg["kill_at"] + 1] - killed, 3),
        "function_to_progress_s": round(times[cfg["kill_at"] + 1] - got["started"], 3),
        "imports_s": round(got["imported"] - got["started"], 3),
        "after_imports_to_progress_s": round(times[cfg["kill_at"] + 1] - got["imported"], 3),
        "steps_trained_again": cfg["kill_at"] - int(got["resumed_after"]),
        "timeline_s": {
            name: round(at - killed, 3)
            for name, at in sorted(
                {"function": got["started"], "imported": got["imported"], **got["marks"]}.items(),
                key=lambda item: item[1],
            )
        },
        "tier": got["tier"],
        "volume_bytes_read": None if served is None else served - kill["served"],
    }


def _nothing() -> None:
    """A first launch's function: it starts the forkserver."""


def _warm_forkserver(timeout: float = 120.0) -> None:
    """Start the forkserver and wait until it has imported its preloads (the stack's library
    among them): both paths' ranks then start forked from it, as a notebook's later calls
    do. A launch that comes earlier starts its ranks fresh, and a failed fresh rank ends
    through the interpreter's exit, which would add seconds to whichever path ran first."""
    from nbtools.launch._local import _forkserver

    distributed(processes=2, output="none")(_nothing).distributed()
    deadline = time.monotonic() + timeout
    while not _forkserver.ready() and time.monotonic() < deadline:
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stack", choices=["hf", "lightning", "both"], default="both")
    parser.add_argument("--quick", action="store_true", help="2 ranks, 48 MB, local volumes")
    for name in ("processes", "state_mb", "every", "memory_every", "kill_at"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    parser.add_argument("--mbps", type=float, default=100.0, help="the volume's cap")
    args = vars(parser.parse_args())
    cfg = dict(SETUPS["quick" if args["quick"] else "issue"])
    cfg.update({k: v for k, v in args.items() if k in cfg and v is not None})
    if not cfg["every"] < cfg["kill_at"] or cfg["processes"] < 2:
        parser.error("--kill-at must come after the first --every, with 2 --processes or more")
    cfg["stack"], cfg["endpoint"] = args["stack"], None
    if args["quick"]:
        _main(cfg, "local directories")
        return
    sys.path.insert(0, _TESTS)
    from _restore_servers import s3_env, s3_server

    with s3_server(args["mbps"]) as endpoint:
        os.environ.update(s3_env(endpoint))  # before the forkserver starts: its ranks get it
        import s3fs

        fs = s3fs.S3FileSystem()
        fs.mkdir(BUCKET)
        cfg["endpoint"] = endpoint
        try:
            _main(cfg, f"capped S3 at {args['mbps']:g} MB/s")
        finally:
            s3fs.S3FileSystem.close_session(fs.loop, fs.s3)


def _main(cfg: dict[str, Any], volume: str) -> None:
    stacks = ["hf", "lightning"] if cfg["stack"] == "both" else [cfg["stack"]]
    # As a notebook's cells do before the first launch: the forkserver the ranks start
    # from then holds the libraries too, and a restarted rank does not import them again.
    for stack in stacks:
        importlib.import_module("transformers.trainer" if stack == "hf" else "lightning.pytorch")
    _warm_forkserver()
    for stack in stacks:
        theirs = _run(stack, "trainer", cfg)  # today's path first
        ours = _run(stack, "nbtools", cfg)
        result = {
            "benchmark": "recovery_trainers",
            "stack": stack,
            "processes": cfg["processes"],
            "state_mb": _layers(cfg["state_mb"]) * HIDDEN * (HIDDEN + 1) * 12 // 10**6,
            "every": cfg["every"],
            "memory_every": cfg["memory_every"],
            "kill_at": cfg["kill_at"],
            "volume": volume,
            "nbtools": ours,
            "trainer": theirs,
            "kill_to_first_step_x": round(
                ours["kill_to_first_step_s"] / theirs["kill_to_first_step_s"], 3
            ),
            "kill_to_progress_x": round(
                ours["kill_to_progress_s"] / theirs["kill_to_progress_s"], 3
            ),
        }
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
