"""Listing a large volume: once per job with the shared index, against a listing per rank.

Generates a tree of empty files (100,000 and 1,000,000 entries, 1,000 per
directory; on a tmpfs of its own when run as root, else under the temp
directory), backdated so that its directories look written a while ago, and
measures for a job of 2 ranks x 2 loader workers (gloo, really started):

* ``cold``: the first launch, no index yet: ``VolumeDataset`` + ``DataLoader``
  until the first batch; ``warm``: a second launch over the unchanged tree;
  ``other_node``: a launch with an empty private cache (another node), which
  copies the index the cold launch kept in the root (``index_in_root=True``;
  the tree has its ``.nbtools-index`` directory from the start, as a prepared
  dataset would); ``two_nodes_at_once``: two such jobs (empty caches, no index
  anywhere) started at the same moment, their listings added up: one lists
  while the other waits for its index (the listing lease);
* ``listings``: directories listed (``os.scandir`` calls, counted in every
  rank process) per job;
* ``first_batch_s``: the slowest rank's time from building the dataset to its
  first batch;
* ``private_bytes_per_file``: growth of each process's private dirty memory
  (``/proc/self/smaps_rollup``) for the file list, per file, the largest over
  ranks (until the first batch) and over loader workers (their first path);
* with ``--recent``: ``first``, ``second`` and ``third`` launch over a tree
  whose last directories (and root) were written just before the first
  listing; ``second_over_third`` is the second launch's time to the first
  batch over the warm third's;
* ``per_rank_listing``: today's way, each rank walking the tree itself into
  Python tuples (the listing the index replaces), measured in the same run
  with the same 2 rank processes; ``scandir_walk``: one plain ``os.scandir``
  walk in one process, for scale.

Prints one JSON line. Everything it made (tree, cache, mount) is removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import IterableDataset, get_worker_info

from nbtools.data import DataLoader, VolumeDataset

__all__ = ["main"]

_PER_DIR = 1000


def _private() -> int:
    """Anonymous bytes of this process (heap and copied-on-write pages, not file maps)."""
    with open("/proc/self/smaps_rollup") as fh:
        for line in fh:
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) * 1024
    return 0


_SCANS = [0]


def _count_scandir() -> None:
    real = os.scandir

    def counting(path="."):
        _SCANS[0] += 1
        return real(path)

    os.scandir = counting


class _First(IterableDataset):
    """Yields (path length, private bytes this worker gained for its first path)."""

    def __init__(self, files: VolumeDataset) -> None:
        self.files = files

    def __iter__(self):
        before = _private()
        first = True
        for path in self.files:
            grown = _private() - before if first and get_worker_info() is not None else 0
            first = False
            yield len(path), grown


def _old_listing(root: str) -> list[tuple[str, int, int]]:
    """The per-rank listing the index replaces: a walk into sorted Python tuples."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        rel_dir = os.path.relpath(dirpath, root)
        for name in filenames:
            st = os.stat(os.path.join(dirpath, name))
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            found.append((rel, st.st_size, st.st_mtime_ns))
    found.sort()
    return [tuple(e[0] for e in found), tuple(e[1] for e in found), tuple(e[2] for e in found)]


def _rank(rank: int, work: str, mode: str, port: int, n: int) -> None:
    cache = f"{work}/cache-{mode}" if mode.startswith("node") else f"{work}/cache"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    _count_scandir()
    out: dict = {}
    try:
        dist.barrier()
        before, start = _private(), time.perf_counter()
        if mode == "old":
            listing = _old_listing(f"{work}/tree")
            out["first_batch_s"] = time.perf_counter() - start
            out["private"] = _private() - before
            assert len(listing[0]) == n
        else:
            files = VolumeDataset(f"{work}/tree", cache_dir=cache, shuffle=True, index_in_root=True)
            with DataLoader(_First(files), batch_size=32, num_workers=2) as loader:
                it = iter(loader)
                batch = next(it)
                out["first_batch_s"] = time.perf_counter() - start
                out["private"] = _private() - before
                grown = [int(g) for g in batch[1]]
                second = next(it)  # the other worker's first batch
                grown += [int(g) for g in second[1]]
                out["worker_private"] = max(grown)
                assert len(files) == n
        out["scans"] = _SCANS[0]
    finally:
        dist.destroy_process_group()
    with open(f"{work}/{mode}-{rank}.json", "w") as fh:
        json.dump(out, fh)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _jobs(work: str, modes: list[str], n: int) -> dict:
    """Jobs of 2 ranks each, started at the same moment; their listings added up."""
    running = [
        mp.start_processes(
            _rank, args=(work, mode, _free_port(), n), nprocs=2, start_method="fork", join=False
        )
        for mode in modes
    ]
    for context in running:
        while not context.join():
            pass
    ranks = []
    for mode in modes:
        for r in range(2):
            with open(f"{work}/{mode}-{r}.json") as fh:
                ranks.append(json.load(fh))
    out = {
        "listings": sum(r["scans"] for r in ranks),
        "first_batch_s": round(max(r["first_batch_s"] for r in ranks), 3),
        "private_bytes_per_file": round(max(r["private"] for r in ranks) / n, 2),
    }
    if "worker_private" in ranks[0]:
        out["worker_private_bytes_per_file"] = round(max(r["worker_private"] for r in ranks) / n, 2)
    return out


def _job(work: str, mode: str, n: int) -> dict:
    return _jobs(work, [mode], n)


def _make_tree(root: str, n: int) -> int:
    dirs = 0
    for i in range(n):
        if i % _PER_DIR == 0:
            d = os.path.join(root, f"d{i // _PER_DIR:05d}")
            os.makedirs(d)
            dirs += 1
        os.close(os.open(os.path.join(d, f"f{i:08d}.bin"), os.O_CREAT | os.O_WRONLY, 0o644))
    os.makedirs(os.path.join(root, ".nbtools-index"))
    past = time.time() - 3600
    for dirpath, _, _ in os.walk(root):
        os.utime(dirpath, (past, past))
    return dirs + 1


def _scandir_walk(root: str) -> tuple[int, float]:
    start = time.perf_counter()
    stack, files = [root], 0
    while stack:
        with os.scandir(stack.pop()) as it:
            for entry in it:
                if entry.is_dir():
                    stack.append(entry.path)
                else:
                    entry.stat()
                    files += 1
    return files, time.perf_counter() - start


@contextlib.contextmanager
def _workdir():
    work = tempfile.mkdtemp(prefix="nbtools-bench-listing-")
    mounted = False
    try:
        if os.geteuid() == 0 and shutil.which("mount"):
            done = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=4g,nr_inodes=3m", "tmpfs", work],
                capture_output=True,
                check=False,
            )
            mounted = done.returncode == 0
        yield work, "tmpfs" if mounted else "temp directory"
    finally:
        if mounted:
            subprocess.run(["umount", "-l", work], capture_output=True, check=False)
        shutil.rmtree(work, ignore_errors=True)


def _measure(n: int) -> dict:
    with _workdir() as (work, where):
        dirs = _make_tree(f"{work}/tree", n)
        files, walk_s = _scandir_walk(f"{work}/tree")
        assert files == n
        result = {
            "entries": n,
            "directories": dirs,
            "tree_on": where,
            "cold": _job(work, "new", n),
        }
        result["warm"] = _job(work, "new", n)
        result["other_node"] = _job(work, "node", n)
        result["per_rank_listing"] = _job(work, "old", n)
        # Two nodes start at once on a root with no index anywhere: one lists, one waits.
        for name in os.listdir(f"{work}/tree/.nbtools-index"):
            os.unlink(f"{work}/tree/.nbtools-index/{name}")
        result["two_nodes_at_once"] = _jobs(work, ["node-a", "node-b"], n)
        result["scandir_walk"] = {"listings": dirs, "seconds": round(walk_s, 3)}
        return result


def _measure_racy(n: int) -> dict:
    """Three launches over a tree whose last directories were written just before the first.

    The last 3 directories and the root get a modification time one second
    ahead, so that the first launch, started within that second, lists them as
    just written. The second launch re-checks those directories; the third is
    the warm baseline of the same run.
    """
    with _workdir() as (work, where):
        dirs = _make_tree(f"{work}/tree", n)
        ahead = time.time() + 1.0
        names = sorted(d for d in os.listdir(f"{work}/tree") if d.startswith("d"))
        for rel in (*names[-3:], ""):
            os.utime(f"{work}/tree/{rel}", (ahead, ahead))
        result = {"entries": n, "directories": dirs, "tree_on": where, "recent_directories": 4}
        result["first"] = _job(work, "new", n)
        result["second"] = _job(work, "new", n)
        result["third"] = _job(work, "new", n)
        third = max(result["third"]["first_batch_s"], 1e-3)
        result["second_over_third"] = round(result["second"]["first_batch_s"] / third, 2)
        return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--entries", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument(
        "--recent",
        action="store_true",
        help="only the launches over a tree written just before its first listing",
    )
    args = parser.parse_args()
    runs = [(_measure_racy if args.recent else _measure)(n) for n in args.entries]
    print(
        json.dumps(
            {
                "benchmark": "listing",
                "ranks": 2,
                "workers": 2,
                "runs": runs,
                "goals": {
                    "listings_cold": "directories once per job",
                    "listings_warm": 0,
                    "first_batch_warm_s_at_1m": 1.0,
                    "private_bytes_per_file": 16,
                },
            }
        )
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
