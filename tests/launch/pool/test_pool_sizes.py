"""Values of real sizes travel both ways between the notebook and pool ranks."""

from __future__ import annotations

import os

import pytest
import torch

from nbtools.launch import RankPool

_MIB = 1 << 20


def _cell(source: str) -> dict:
    """The globals of a notebook cell that ran ``source`` (its functions are ``__main__``'s)."""
    namespace = {"__name__": "__main__"}
    exec(compile(source, "<cell>", "exec"), namespace)  # a test's own cell
    return namespace


def test_megabyte_values_go_both_ways_and_the_pool_keeps_working():
    x = torch.randn(256, 1024)  # 1 MiB
    cell = _cell(
        "import torch\n"
        "table = torch.arange(1024 * 1024, dtype=torch.float32)  # 4 MiB, a notebook global\n"
        "def lookup(i):\n"
        "    return float(table[i]) + float(x.sum())\n"
    )
    with RankPool(processes=2, output="none") as pool:
        pool.push(x=x)
        assert pool.execute("float(x.sum())") == [pytest.approx(float(x.sum()))] * 2
        assert pool.run(cell["lookup"], 7) == [pytest.approx(7 + float(x.sum()))] * 2
        pool.execute("y = x * 2")
        back = pool.pull("y")
        assert all(torch.equal(b, x * 2) for b in back)
        assert pool.execute("1 + 1") == [2, 2]


@pytest.mark.slow
def test_a_quarter_gigabyte_value_is_pushed_and_pulled():
    size = 256 * _MIB
    with RankPool(processes=2, output="none") as pool:
        value = torch.ones(size // 4, dtype=torch.float32)
        pool.push(big=value)
        del value
        assert pool.execute("(big.numel() * 4, float(big.sum()))") == [(size, size / 4)] * 2
        pool.execute("big = big * 3\nimport gc\ngc.collect()")
        first, second = pool.pull("big")
        assert first.numel() * 4 == size and float(first[-1]) == 3.0
        assert torch.equal(first, second)
        del first, second
        pool.execute("del big")
        assert pool.execute("1") == [1, 1]


def test_a_pushed_tensor_travels_out_of_band_and_an_unpicklable_part_is_named():
    from nbtools.errors import PicklingError
    from nbtools.launch import _payload

    framed = _payload.pack_push(None, {"x": torch.ones(4 * _MIB // 4)})
    assert len(framed.buffers) == 1 and len(framed.data) < 10_000  # not inside the pickle
    cell = _cell(
        "import threading\n"
        "class Holder:\n"
        "    def __init__(self):\n"
        "        self.lock = threading.Lock()\n"
    )
    with pytest.raises(PicklingError, match=r"'state'.*state\['model'\]\.lock \(a lock\)"):
        _payload.pack_push(None, {"state": {"model": cell["Holder"](), "n": 1}})


def test_a_cell_class_and_a_large_tensor_pushed_together_arrive_intact():
    cell = _cell(
        "class Config:  # a notebook class: travels by value\n"
        "    def __init__(self, lr):\n"
        "        self.lr = lr\n"
    )
    x = torch.arange(16 * _MIB // 4, dtype=torch.float32)
    with RankPool(processes=2, output="none") as pool:
        pool.push(config=cell["Config"](0.5), x=x)
        assert (
            pool.execute("(type(config).__name__, config.lr, float(x[-1]))")
            == [("Config", 0.5, float(x[-1]))] * 2
        )
        pool.execute("x += 1")  # the received tensor is the rank's own, writable
        assert all(torch.equal(b, x + 1) for b in pool.pull("x"))


def _memory_files() -> list[str]:
    names = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            names.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return [n for n in names if "nbtools-push" in n]


def test_a_large_push_is_shared_in_memory_once_and_closed_after_the_call():
    x = torch.ones(32 * _MIB // 4)
    with RankPool(processes=2, output="none") as pool:
        pool.push(x=x)
        assert _memory_files() == []  # the kernel's descriptor went with the call
        mapped = pool.execute("open('/proc/self/maps').read().count('nbtools-push')")
        assert all(count >= 1 for count in mapped), mapped  # each rank maps the kernel's pages
        pool.execute("x[0] = 5.0")  # copy-on-write: the rank's change is its own
        assert x[0] == 1.0 and [float(v[0]) for v in pool.pull("x")] == [5.0, 5.0]
        pool.execute("del x\nimport gc\ngc.collect()")
        assert pool.execute("open('/proc/self/maps').read().count('nbtools-push')") == [0, 0]


def _entries() -> set[str]:
    return {f"/dev/shm/{n}" for n in os.listdir("/dev/shm")} | {
        f"/tmp/{n}" for n in os.listdir("/tmp")
    }


@pytest.mark.slow
def test_ranks_that_cannot_open_the_kernels_memory_files_get_pushes_by_socket(monkeypatch):
    # What a rank meets under a hardened /proc (hidepid, another user): it cannot open
    # /proc/<kernel pid>/fd/N. The variable makes every rank take that path here.
    monkeypatch.setenv("NBTOOLS_POOL_SHARED_MEMORY", "0")
    before = _entries()
    x = torch.randn(64 * _MIB // 4, generator=torch.Generator().manual_seed(3))  # 64 MiB
    with RankPool(processes=2, output="none") as pool:
        made = {pool._run_dir, os.path.dirname(str(pool._gens.live().listener.address))}
        pool.push(x=x)
        assert _memory_files() == []
        assert pool.execute("open('/proc/self/maps').read().count('nbtools-push')") == [0, 0]
        sums = pool.execute("(x.numel(), float(x.double().sum()), float(x[-1]))")
        assert sums == [(x.numel(), float(x.double().sum()), float(x[-1]))] * 2
        assert all(torch.equal(b, x) for b in pool.pull("x"))
        pool.execute("x += 1")  # the received tensor is the rank's own, writable
        assert all(torch.equal(b, x + 1) for b in pool.pull("x"))
    # What this pool could leave: its run and socket directories and push memory files
    # (other processes of the machine, other tests' pools and launches among them, make and
    # remove their own meanwhile).
    left = {e for e in _entries() - before if e in made or "nbtools-push" in e}
    assert not left, left
