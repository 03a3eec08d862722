"""Values of real sizes travel both ways between the notebook and pool ranks."""

from __future__ import annotations

import pytest
import torch

from nbtools.launch import RankPool

_MIB = 1 << 20


def _cell(source: str) -> dict:
    """The globals of a notebook cell that ran ``source`` (its functions are ``__main__``'s)."""
    namespace = {"__name__": "__main__"}
    exec(compile(source, "<cell>", "exec"), namespace)  # noqa: S102 - a test's own cell
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
