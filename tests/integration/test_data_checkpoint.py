"""The loader's position saved and restored through CheckpointManager (exactly-once resume)."""

from __future__ import annotations

import os
import sys

from nbtools.checkpoint import CheckpointManager
from nbtools.data import DataLoader, VolumeDataset

_HELPERS = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "data"))
if _HELPERS not in sys.path:
    sys.path.insert(0, _HELPERS)
from _data_helpers import Indices, make_tree  # noqa: E402


def _loader(tmp_path, workers):
    files = VolumeDataset(tmp_path / "src", cache_dir=tmp_path / "cache", shuffle=True, seed=9)
    return DataLoader(Indices(files), batch_size=4, num_workers=workers)


def test_checkpointed_position_resumes_the_epoch_exactly_once(tmp_path):
    make_tree(tmp_path / "src", 30)
    ckpt = CheckpointManager(tmp_path / "ckpt", every=3, async_save=False)
    seen = []
    with _loader(tmp_path, 2) as loader:
        for step, batch in enumerate(loader):
            seen += batch.tolist()
            ckpt.maybe_save(step, data=loader)
            if step == 3:
                break  # the run dies after step 3, which was saved
    ckpt.close()

    ckpt = CheckpointManager(tmp_path / "ckpt", every=3, async_save=False)
    with _loader(tmp_path, 1) as resumed:
        assert ckpt.restore(data=resumed) == 4
        rest = [i for b in resumed for i in b.tolist()]
    ckpt.close()
    assert len(seen) == 16
    assert sorted(seen + rest) == list(range(30))
