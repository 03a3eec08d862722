"""Restore benchmark: bytes served and wall time of multi-rank restores from a capped object store.

Prints one JSON line. A data-parallel checkpoint (a model of 4 x 2048 x 2048
float32 weights plus Adam state, about 200 MB) is restored on 2, 4 and 8 CPU
ranks (gloo), and an FSDP2 checkpoint of the same model saved on 2 ranks is
restored on 4. The checkpoints are served by an S3-compatible server on
loopback (moto behind ``benchmarks/_capped_s3.py``) capped at ``--mbps``, which
counts the object bytes it sends. Baselines in the same run: PyTorch's
``FsspecReader`` on the same server, PyTorch's ``FileSystemReader`` on a FUSE
mount of the same files that counts what it serves (direct I/O,
``benchmarks/_counting_fs.py``; uncapped) and one read of the checkpoint at
the cap (size / bandwidth). Two ceilings are measured too: ``one_client_read_s``,
one process reading the checkpoint's bytes from the server in parallel ranged
GETs (what the capped server delivers on this machine), and per world
``gloo_broadcast_s``, a plain gloo broadcast of the checkpoint's bytes over the
same ranks. Per restore: ``served_x`` (bytes served / checkpoint size),
``wall_s``, and for nbtools ``mem_x``: the largest extra peak RSS of a rank
during the load over (its own state + 2 chunks), with ``extra_peak_mb`` per
rank and ``bound_mb``. At 4 data-parallel ranks, ``phases_s`` gives each rank's
seconds per phase of the load (``*_at``/``*_from``: when, since the load began;
``cpu``: the rank's CPU seconds) and ``server_cpu_s`` the server's.

    python benchmarks/restore.py [--mbps 100] [--worlds 2,4,8] [--chunk-mib 32] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp

warnings.filterwarnings("ignore")
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "tests", "checkpoint"))
from _restore_servers import fuse_mount, fuse_reason, s3_env, s3_server  # noqa: E402

from nbtools import distributed  # noqa: E402
from nbtools.checkpoint import VolumeReader, VolumeWriter  # noqa: E402

BUCKET = "bench"


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(4)])


def _state(model: torch.nn.Module):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _restore_job(cfg: dict, model_fn, state_fn) -> dict:
    """Every restore of one launch; rank 0's dict carries the figures."""
    import threading

    import psutil
    import torch.distributed as dist
    from _restore_servers import fuse_served, s3_served
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    sys.path.insert(0, cfg["tests"])
    rank, world = dist.get_rank(), dist.get_world_size()
    stage = os.path.join(cfg["work"], f"stage-{world}-{rank}")
    os.makedirs(stage, exist_ok=True)

    def fresh():
        if cfg["fsdp"]:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            model = model_fn(1)
            fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
            return state_fn(model)
        return state_fn(model_fn(1))

    def own_bytes(state) -> int:
        total = 0
        for value in [*state["model"].values(), *state["optim"]["state"].values()]:
            tensors = value.values() if isinstance(value, dict) else [value]
            for t in tensors:
                local = t.to_local() if hasattr(t, "to_local") else t
                total += local.numel() * local.element_size()
        return total

    def run(name: str, reader, served) -> dict:
        state = fresh()
        proc = psutil.Process()
        base = proc.memory_info().rss
        peak = [base]
        done = threading.Event()

        def sample():
            while not done.wait(0.01):
                peak[0] = max(peak[0], proc.memory_info().rss)

        watcher = threading.Thread(target=sample, daemon=True)
        dist.barrier()
        before = served()
        dist.barrier()
        watcher.start()
        server = _server_process(endpoint)
        cpu0, server0 = sum(proc.cpu_times()[:2]), sum(server.cpu_times()[:2])
        began = time.perf_counter()
        dcp.load(state, storage_reader=reader)
        dist.barrier()
        wall = time.perf_counter() - began
        cpu = sum(proc.cpu_times()[:2]) - cpu0
        server_cpu = sum(server.cpu_times()[:2]) - server0
        done.set()
        watcher.join()
        sent = served() - before
        bound = own_bytes(state) + 2 * cfg["chunk"]
        extras: list = [None] * world
        dist.all_gather_object(extras, (peak[0] - base) / 1e6)
        del state
        figures = {
            "served_x": round(sent / cfg["size"], 3),
            "wall_s": round(wall, 2),
            "mem_x": round(max(extras) * 1e6 / bound, 2),
            "extra_peak_mb": [round(x, 1) for x in extras],
            "bound_mb": round(bound / 1e6, 1),
        }
        timings = getattr(getattr(reader, "_fetch", None), "timings", None)
        if timings is not None:
            seconds = {k: round(v, 2) for k, v in timings.seconds.items()}
            seconds["cpu"] = round(cpu, 2)
            phases: list = [None] * world
            dist.all_gather_object(phases, seconds)
            figures["phases_s"] = phases
            figures["server_cpu_s"] = round(server_cpu, 2)
        return figures

    def gloo_broadcast_s() -> float:
        """A plain gloo broadcast of the checkpoint's bytes, in chunks from each rank in turn."""
        buf = torch.empty(cfg["chunk"], dtype=torch.uint8)
        dist.barrier()
        began = time.perf_counter()
        left, src = cfg["size"], 0
        while left > 0:
            n = min(left, cfg["chunk"])
            dist.broadcast(buf[:n], src=src)
            left, src = left - n, (src + 1) % world
        dist.barrier()
        return round(time.perf_counter() - began, 2)

    url = f"s3://{BUCKET}/{cfg['name']}"
    endpoint = cfg["endpoint"]
    out = {
        "gloo_broadcast_s": gloo_broadcast_s(),
        "nbtools": run(
            "nbtools",
            VolumeReader(url, staging_dir=stage, chunk_size=cfg["chunk"]),
            lambda: s3_served(endpoint),
        ),
    }
    if cfg["baselines"]:
        out["torch_fsspec"] = run("torch_fsspec", FsspecReader(url), lambda: s3_served(endpoint))
    if cfg["mount"] and not cfg["fsdp"] and cfg["baselines"]:
        ctl = cfg["ctl"]
        out["torch_fs_mount"] = run(
            "torch_fs_mount", FileSystemReader(cfg["mount"]), lambda: fuse_served(ctl)
        )
        out["torch_fs_mount"].pop("mem_x")
    for key, figures in out.items():
        if key != "nbtools" and isinstance(figures, dict):
            for extra in ("mem_x", "extra_peak_mb", "bound_mb"):
                figures.pop(extra, None)
    if world != 4 or cfg["fsdp"]:
        out["nbtools"].pop("phases_s", None)
    shutil.rmtree(stage, ignore_errors=True)
    return out


def _server_process(endpoint: str):
    """The S3 server's process (psutil), found by the port in its command line."""
    import psutil

    port = endpoint.rsplit(":", 1)[1]
    for proc in psutil.process_iter(["cmdline"]):
        line = proc.info["cmdline"] or []
        if any(a.endswith("_capped_s3.py") for a in line) and port in line:
            return proc
    raise RuntimeError(f"no S3 server on port {port}")


def _save_fsdp(cfg: dict, model_fn, state_fn) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = model_fn(0)
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    dcp.save(state_fn(model), storage_writer=VolumeWriter(f"s3://{BUCKET}/fsdp"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mbps", type=float, default=100.0)
    parser.add_argument("--worlds", default="2,4,8")
    parser.add_argument("--chunk-mib", type=int, default=32)
    parser.add_argument(
        "--quick", action="store_true", help="nbtools only (no PyTorch readers, no FSDP2)"
    )
    args = parser.parse_args()
    import s3fs

    work = tempfile.mkdtemp(prefix="nbtools-bench-restore-")
    result: dict = {"mbps_cap": args.mbps}
    try:
        with s3_server(args.mbps) as endpoint:
            os.environ.update(s3_env(endpoint))
            fs = s3fs.S3FileSystem()
            fs.mkdir(BUCKET)
            state = _state(_model(0))
            dcp.save(state, storage_writer=VolumeWriter(f"s3://{BUCKET}/dp"))
            src = os.path.join(work, "dp_src")
            dcp.save(state, storage_writer=VolumeWriter(src))
            del state
            size = sum(fs.du(f"{BUCKET}/dp", total=False).values())
            result["dp_mb"] = round(size / 1e6, 1)
            result["one_read_at_cap_s"] = round(size / (args.mbps * 1e6), 2)
            result["one_client_read_s"] = _client_read(fs, f"{BUCKET}/dp", args.chunk_mib << 20)
            base = {
                "endpoint": endpoint,
                "work": work,
                "tests": os.path.join(_HERE, "..", "tests", "checkpoint"),
                "chunk": args.chunk_mib << 20,
                "baselines": not args.quick,
            }
            reason = fuse_reason()
            mnt, ctl = os.path.join(work, "mnt"), os.path.join(work, "ctl")
            with fuse_mount(src, mnt, ctl) if reason is None else _null() as mount:
                for world in [int(w) for w in args.worlds.split(",")]:
                    cfg = {**base, "name": "dp", "size": size, "fsdp": False, "mount": mount}
                    cfg["ctl"] = ctl
                    job = distributed(processes=world, output="none")(_restore_job)
                    result[f"dp_{world}"] = job.distributed(cfg, _model, _state)[0]
            if not args.quick:
                distributed(processes=2, output="none")(_save_fsdp).distributed(
                    {**base}, _model, _state
                )
                fsdp_size = sum(fs.du(f"{BUCKET}/fsdp", total=False).values())
                cfg = {**base, "name": "fsdp", "size": fsdp_size, "fsdp": True, "mount": None}
                job = distributed(processes=4, output="none")(_restore_job)
                result["fsdp_2_to_4"] = job.distributed(cfg, _model, _state)[0]
            if reason is not None:
                result["mount_skipped"] = reason
            s3fs.S3FileSystem.close_session(fs.loop, fs.s3)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    four = result.get("dp_4", {})
    if four.get("nbtools"):
        cap = result["one_read_at_cap_s"]
        result["dp_4_wall_over_one_read"] = round(four["nbtools"]["wall_s"] / cap, 2)
        result["dp_4_gloo_broadcast_over_one_read"] = round(four["gloo_broadcast_s"] / cap, 2)
    result["max_served_x"] = max(
        v["nbtools"]["served_x"]
        for k, v in result.items()
        if isinstance(v, dict) and "nbtools" in v
    )
    print(json.dumps(result))


def _client_read(fs, prefix: str, piece: int) -> float:
    """Seconds one client takes to read every object under ``prefix`` from the server, in
    parallel ranged GETs of ``piece`` bytes (what the server itself delivers)."""
    paths, starts, ends = [], [], []
    for path, size in fs.du(prefix, total=False).items():
        for at in range(0, size, piece):
            paths.append(path)
            starts.append(at)
            ends.append(min(size, at + piece))
    began = time.perf_counter()
    fs.cat_ranges(paths, starts, ends)
    return round(time.perf_counter() - began, 2)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
