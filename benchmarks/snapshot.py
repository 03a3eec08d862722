"""Memory-snapshot benchmark: how long a snapshot blocks training, on the GPU where there is one.

Prints one JSON line. One process, a model of ``--tensors`` x ``--numel`` float32
parameters plus Adam state (on ``--device``: CUDA when available, else CPU), and
``CheckpointManager(root, every=10**9, memory_every=1)``: every ``maybe_save``
takes a memory snapshot and no volume checkpoint. Figures:

- ``blocked_per_snapshot_s``: median time ``maybe_save`` blocks the caller (on
  CUDA: queueing the copies into the pinned mirrors; on the CPU: the copy of
  what a forward pass may change; the rest runs in the background, and each
  round waits for it before the next step so rounds do not overlap);
- ``plain_copy_s``: the baseline in the same run: the median time of copying the
  same tensors into preallocated (pinned, on CUDA) host buffers and synchronizing;
- ``blocked_over_copy`` = the first over the second (goal <= 1.5; on CUDA the
  goal is <= 50 ms for 8 GB of state);
- ``pageable_copy_s`` (CUDA only): a blocking copy of the same tensors into
  pageable host memory, what a snapshot cost before the mirrors;
- ``steps_per_s_x``: the optimizer step rate with a snapshot at every step over
  the rate without, in alternating blocks of ``--rounds`` steps (goal >= 0.98 on
  CUDA).

The snapshots go to ``NBTOOLS_SNAPSHOT_DIR`` or ``/dev/shm``; where the state does
not fit there, the tier turns itself off with a warning, and the run says so.

    python benchmarks/snapshot.py [--numel 25000000] [--tensors 6] [--rounds 7]
        [--device cuda|cpu]
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import tempfile
import time

import torch

from nbtools.checkpoint import CheckpointManager


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--tensors", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is visible to this process")

    device = torch.device(args.device)
    torch.manual_seed(0)
    model = torch.nn.ParameterList(
        [torch.nn.Parameter(torch.randn(args.numel, device=device)) for _ in range(args.tensors)]
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sum(p.sum() for p in model.parameters()).backward()
    opt.step()  # Adam's state exists: params + exp_avg + exp_avg_sq
    _sync(device)
    tensors = [t for p in model.parameters() for t in (p, *opt.state[p].values()) if t.dim()]
    state_gb = sum(t.numel() * t.element_size() for t in tensors) / 1e9

    pinned = device.type == "cuda"
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for t in tensors]
    copies = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        for h, t in zip(host, tensors, strict=True):
            h.copy_(t, non_blocking=pinned)
        _sync(device)
        copies.append(time.perf_counter() - start)
    del host
    pageable: list[float] = []
    if pinned:  # what a snapshot of CUDA state cost before the pinned mirrors
        plain_host = [torch.empty(t.shape, dtype=t.dtype) for t in tensors]
        for _ in range(args.rounds):
            start = time.perf_counter()
            for h, t in zip(plain_host, tensors, strict=True):
                h.copy_(t)
            pageable.append(time.perf_counter() - start)
        del plain_host

    def train_step() -> None:
        opt.zero_grad(set_to_none=True)
        sum((p * p).sum() for p in model.parameters()).backward()
        opt.step()

    warnings: list[str] = []

    class _Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    handler = _Catch()
    logging.getLogger("nbtools").addHandler(handler)
    root = tempfile.mkdtemp(prefix="nbtools-bench-snapshot-")
    blocked = []
    try:
        ckpt = CheckpointManager(root, every=10**9, memory_every=1, keep=2)
        for step in range(args.rounds + 1):
            _sync(device)
            start = time.perf_counter()
            ckpt.maybe_save(step, model=model, optimizer=opt)
            elapsed = time.perf_counter() - start
            ckpt.wait()
            if step:  # the first snapshot allocates the host buffers
                blocked.append(elapsed)
        # Step rates, paired block by block: a snapshot after every step, and none.
        rates: dict[bool, list[float]] = {True: [], False: []}
        step = args.rounds + 1
        for _ in range(3):
            for snapshots in (False, True):
                _sync(device)
                start = time.perf_counter()
                for _ in range(args.rounds):
                    train_step()
                    step += 1
                    if snapshots:
                        ckpt.maybe_save(step, model=model, optimizer=opt)
                _sync(device)
                rates[snapshots].append(args.rounds / (time.perf_counter() - start))
                ckpt.wait()
        ckpt.close()
    finally:
        logging.getLogger("nbtools").removeHandler(handler)
        shutil.rmtree(root, ignore_errors=True)

    plain = statistics.median(copies)
    ours = statistics.median(blocked)
    figures = {
        "benchmark": "snapshot",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "state_gb": round(state_gb, 3),
        "rounds": args.rounds,
        "plain_copy_s": round(plain, 4),
        "blocked_per_snapshot_s": round(ours, 4),
        "blocked_over_copy": round(ours / plain, 2),
        "goal_blocked_le_1.5x_copy": ours / plain <= 1.5,
        "steps_per_s_x": round(statistics.median(rates[True]) / statistics.median(rates[False]), 3),
        "memory_tier_warnings": warnings[:3],
    }
    if pageable:
        figures["pageable_copy_s"] = round(statistics.median(pageable), 4)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
