"""torchdata's ``StatefulDataLoader`` over ``VolumeDataset``: with workers it fails at the
first batch with an error saying what to use instead (it hung on two ranks before,
each worker waiting in a collective); without workers it resumes exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("torchdata")

from torchdata.stateful_dataloader import StatefulDataLoader

from nbtools.data import VolumeDataset
from nbtools.errors import DataError


class _Decoded(torch.utils.data.IterableDataset):
    """A decoding wrapper that hands its position to the loader, as users write them."""

    def __init__(self, inner: VolumeDataset) -> None:
        self.inner = inner

    def __iter__(self):
        for path in self.inner:
            yield torch.from_numpy(np.fromfile(path, dtype=np.float32))

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state):
        self.inner.load_state_dict(state)


def _shut_down_workers(tb) -> None:
    """End the workers of the iterator that failed while being built (its ``__init__``
    raised, so no one holds it but the traceback): a test leaves no process behind."""
    while tb is not None:
        it = tb.tb_frame.f_locals.get("self")
        if callable(getattr(it, "_shutdown_workers", None)):
            it._shutdown_workers()
            return
        tb = tb.tb_next


@pytest.fixture
def volume(tmp_path, monkeypatch):
    monkeypatch.setenv("NBTOOLS_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "vol"
    src.mkdir()
    for i in range(12):
        np.full(4, i, dtype=np.float32).tofile(src / f"{i:03d}.bin")
    return src


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "decoding-wrapper"])
def test_with_workers_the_first_batch_fails_naming_the_loader_to_use(volume, wrapped):
    dataset = VolumeDataset(str(volume))
    loader = StatefulDataLoader(_Decoded(dataset) if wrapped else dataset, num_workers=2)
    with pytest.raises(DataError) as caught:
        next(iter(loader))
    _shut_down_workers(caught.tb)
    message = str(caught.value)
    assert "VolumeDataset.state_dict() was called in loader worker" in message
    assert "StatefulDataLoader" in message and "nbtools.data.DataLoader" in message


def test_without_workers_it_resumes_where_it_stopped(volume):
    def make() -> StatefulDataLoader:
        return StatefulDataLoader(
            _Decoded(VolumeDataset(str(volume), shuffle=True, seed=3)), batch_size=2
        )

    whole = [b[:, 0].tolist() for b in make()]
    loader = make()
    batches = iter(loader)
    seen = [next(batches)[:, 0].tolist() for _ in range(2)]
    again = make()
    again.load_state_dict(loader.state_dict())
    seen += [b[:, 0].tolist() for b in again]
    assert seen == whole and sorted(sum(whole, [])) == list(range(12))


@pytest.mark.slow
@pytest.mark.kernel
def test_on_two_ranks_with_workers_a_cell_fails_with_the_error_instead_of_hanging(tmp_path):
    from _user_code_nb import NotebookKernel
    from nbclient.exceptions import CellExecutionError

    src = tmp_path / "vol"
    src.mkdir()
    for i in range(12):
        np.full(4, i, dtype=np.float32).tofile(src / f"{i:03d}.bin")
    with NotebookKernel(tmp_path) as nb:
        nb.run(
            f"import os\nos.environ['NBTOOLS_CACHE_DIR'] = {str(tmp_path / 'cache')!r}\n"
            "import numpy as np, torch\n"
            "from nbtools import distributed\n"
            "from nbtools.data import VolumeDataset\n"
            "from torchdata.stateful_dataloader import StatefulDataLoader\n"
        )
        nb.run(
            "class Decoded(torch.utils.data.IterableDataset):\n"
            "    def __init__(self, inner):\n"
            "        self.inner = inner\n"
            "    def __iter__(self):\n"
            "        for p in self.inner:\n"
            "            yield torch.from_numpy(np.fromfile(p, dtype=np.float32))\n"
            "    def state_dict(self):\n"
            "        return self.inner.state_dict()\n"
            "    def load_state_dict(self, state):\n"
            "        self.inner.load_state_dict(state)\n"
        )
        with pytest.raises(CellExecutionError) as caught:
            nb.run(
                "@distributed(processes=2)\n"
                "def first_batch():\n"
                f"    loader = StatefulDataLoader(Decoded(VolumeDataset({str(src)!r})),"
                " batch_size=2, num_workers=2)\n"
                "    return next(iter(loader)).tolist()\n"
                "first_batch.distributed()\n"
            )
    text = str(caught.value)
    assert "VolumeDataset.state_dict() was called in loader worker" in text
    assert "nbtools.data.DataLoader" in text
