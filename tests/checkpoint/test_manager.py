"""CheckpointManager in one process without a process group (a notebook)."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from ckpt_training import Net, make_training, train_step

from nbtools.checkpoint import CheckpointManager, export, find_latest_valid
from nbtools.errors import CheckpointError


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(2).tolist()


def _assert_same_training(a, b) -> None:
    (ma, oa, sa), (mb, ob, sb) = a, b
    for pa, pb in zip(ma.parameters(), mb.parameters(), strict=True):
        assert torch.equal(pa, pb)
    for sa_, sb_ in zip(oa.state.values(), ob.state.values(), strict=True):
        for key in sa_:
            assert torch.equal(sa_[key], sb_[key]), key
    assert sa.state_dict() == sb.state_dict()


@pytest.mark.parametrize("async_save", [True, False])
def test_resume_continues_exactly(tmp_path, async_save):
    root = tmp_path / "ckpt"
    reference = make_training()
    for _ in range(7):
        train_step(*reference)
    expected_draws = _draws()

    run = make_training()
    # No final save on close: the resumed run must replay steps 4-6 exactly.
    with CheckpointManager(root, every=3, async_save=async_save, save_on_close=False) as ckpt:
        assert ckpt.restore(model=run[0], optimizer=run[1], sched=run[2]) == 0
        assert ckpt.restored_step is None
        for step in range(5):
            train_step(*run)
            ckpt.maybe_save(step, model=run[0], optimizer=run[1], sched=run[2], extra={"epoch": 1})
    assert ckpt.last_saved_step == 3
    assert sorted(os.listdir(root)) == ["step_0", "step_3"]

    resumed = make_training(seed=123)  # different init: everything must come from the checkpoint
    random.seed(5)
    np.random.seed(5)
    ckpt = CheckpointManager(root, every=3)
    start = ckpt.restore(model=resumed[0], optimizer=resumed[1], sched=resumed[2])
    assert start == 4 and ckpt.restored_step == 3 and ckpt.last_saved_step == 3
    assert ckpt.extra == {"epoch": 1}
    for _ in range(start, 7):
        train_step(*resumed)
    ckpt.close()
    _assert_same_training(reference, resumed)
    assert _draws() == expected_draws


def test_checkpoint_holds_values_of_the_moment_of_the_call(tmp_path):
    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with CheckpointManager(tmp_path / "c") as ckpt:
        ckpt.save(1, model=model)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # changed while the save may still be running
        ckpt.wait()
    restored = Net()
    CheckpointManager(tmp_path / "c").restore(model=restored)
    for key, value in restored.state_dict().items():
        assert torch.equal(value, before[key])


class _CopyableOnly:
    """Copies fine (staging succeeds) but cannot be serialised (the background write fails)."""

    def __deepcopy__(self, memo):
        return self

    def __reduce_ex__(self, protocol):
        raise TypeError("this value cannot be serialised")


class _Unserialisable(torch.nn.Module):
    """A module whose extra state fails only in the background writer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)
        self.broken = True

    def get_extra_state(self):
        return _CopyableOnly() if self.broken else {"ok": True}

    def set_extra_state(self, state) -> None:
        pass


@pytest.mark.parametrize("next_call", ["save", "maybe_save", "wait", "close"])
def test_background_failure_is_raised_at_the_next_call(tmp_path, next_call):
    root = tmp_path / "c"
    model = _Unserialisable()
    ckpt = CheckpointManager(root, every=100)
    ckpt.save(5, model=model)  # returns: the failure happens while writing shards
    model.broken = False
    with pytest.raises(CheckpointError, match="step 5"):
        if next_call == "save":
            ckpt.save(6, model=model)
        elif next_call == "maybe_save":
            while True:  # not due (every=100), but the failure must surface once it happened
                ckpt.maybe_save(7, model=model)
        else:
            getattr(ckpt, next_call)()
    if next_call != "close":
        ckpt.save(8, model=model)
        ckpt.close()
        assert find_latest_valid(root) == str(root / "step_8")
    assert not (root / "step_5" / ".metadata").exists()


def test_retention_keeps_newest_and_removes_stale_partials(tmp_path):
    root = tmp_path / "c"
    (root / "step_0").mkdir(parents=True)  # a save that died long ago
    (root / "step_0" / "__0_0.distcp").write_bytes(b"x")
    (root / "step_50").mkdir()  # newer than everything: maybe in flight, left alone
    model = Net()
    with CheckpointManager(root, every=2, keep=2, save_on_close=False) as ckpt:
        for step in range(1, 10):
            ckpt.maybe_save(step, model=model)
    assert sorted(os.listdir(root)) == ["step_50", "step_6", "step_8"]


def test_same_step_saved_again_is_replaced(tmp_path):
    model = Net()
    with CheckpointManager(tmp_path / "c", async_save=False) as ckpt:
        assert ckpt.save(3, model=model) is True
        with torch.no_grad():
            model.body.weight.add_(1)
        assert ckpt.save(3, model=model) is True
    fresh = Net()
    assert CheckpointManager(tmp_path / "c").restore(model=fresh) == 4
    assert torch.equal(fresh.body.weight, model.body.weight)


def test_mlflow_run_id_is_recorded(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_RUN_ID", "run-abc")
    with CheckpointManager(tmp_path / "c") as ckpt:
        ckpt.save(0, model=Net())
    monkeypatch.delenv("MLFLOW_RUN_ID")
    ckpt = CheckpointManager(tmp_path / "c")
    ckpt.restore(model=Net())
    assert ckpt.mlflow_run_id == "run-abc"


def test_restore_model_only_and_export(tmp_path):
    model, optimizer, scheduler = make_training()
    train_step(model, optimizer, scheduler)
    with CheckpointManager(tmp_path / "c") as ckpt:
        ckpt.save(4, model=model, optimizer=optimizer, sched=scheduler)
    plain = Net()
    assert CheckpointManager(tmp_path / "c").restore(model=plain) == 5
    assert torch.equal(plain.head.weight, model.head.weight)
    out = tmp_path / "weights.pt"
    assert export(tmp_path / "c", out) == str(tmp_path / "c" / "step_4")
    weights = torch.load(out, weights_only=True)
    fresh = Net()
    fresh.load_state_dict(weights)
    assert torch.equal(fresh.body.bias, model.body.bias)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"keep": 0}, ValueError, "keep must be at least 1"),
        ({"every": 0}, ValueError, "every must be at least 1"),
        ({"every": 2.5}, TypeError, "every must be an int"),
    ],
)
def test_bad_arguments(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        CheckpointManager(tmp_path / "c", **kwargs)
    assert not (tmp_path / "c").exists()


def test_root_that_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        CheckpointManager(tmp_path / "f")
    assert (tmp_path / "f").read_text() == "x"


def test_mismatched_parameter_names_are_listed(tmp_path):
    with CheckpointManager(tmp_path / "c") as ckpt:
        ckpt.save(1, model=Net())
    before = sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "c").rglob("*"))
    other = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    untouched = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointError) as info:
        CheckpointManager(tmp_path / "c").restore(model=other)
    message = str(info.value)
    assert "missing in the checkpoint (4): ['0.bias', '0.weight', '1.bias', '1.weight']" in message
    assert (
        "unexpected in the checkpoint (4): ['body.bias', 'body.weight', 'head.bias', 'head.weight']"
        in message
    )
    assert all(torch.equal(v, untouched[k]) for k, v in other.state_dict().items())
    assert sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "c").rglob("*")) == before


def test_unsaved_object_is_a_clear_error(tmp_path):
    with CheckpointManager(tmp_path / "c") as ckpt:
        ckpt.save(1, model=Net())
    _, optimizer, scheduler = make_training()
    with pytest.raises(CheckpointError, match=r"no state for \['sched'\]"):
        CheckpointManager(tmp_path / "c").restore(model=Net(), sched=scheduler)
    with pytest.raises(TypeError, match="has no state_dict"):
        CheckpointManager(tmp_path / "c").save(2, model=Net(), lr=0.1)


@pytest.mark.root
def test_unwritable_root(tmp_path):
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("needs root to mount a read-only tmpfs")
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mnt)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        with pytest.raises(CheckpointError, match="not writable"):
            CheckpointManager(mnt / "ckpt")
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_closed_manager_refuses_work(tmp_path):
    ckpt = CheckpointManager(tmp_path / "c")
    ckpt.close()
    ckpt.close()
    with pytest.raises(CheckpointError, match="closed"):
        ckpt.save(1, model=Net())


def test_object_store_root(tmp_path):
    import uuid

    import fsspec

    root = f"memory://nbtools-test-{uuid.uuid4().hex}/ckpt"
    try:
        model = Net()
        with CheckpointManager(root, every=1, keep=1) as ckpt:
            for step in range(3):
                ckpt.maybe_save(step, model=model)
        assert find_latest_valid(root) == root + "/step_2"
        restored = Net()
        assert CheckpointManager(root).restore(model=restored) == 3
        assert torch.equal(restored.head.weight, model.head.weight)
        assert sorted(
            p.rsplit("/", 1)[1] for p in fsspec.filesystem("memory").ls(root, detail=False)
        ) == ["step_2"]
    finally:
        fsspec.filesystem("memory").rm(root.rsplit("/", 1)[0], recursive=True)


def _weights(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("async_save", [True, False])
def test_close_saves_the_last_step_reached(tmp_path, async_save):
    root = tmp_path / "c"
    run = make_training()
    ckpt = CheckpointManager(root, every=3, async_save=async_save)
    for step in range(5):  # due at 0 and 3; 4 is the last step, never due
        train_step(*run)
        ckpt.maybe_save(step, model=run[0], optimizer=run[1], extra={"at": step})
    final = _weights(run[0])
    ckpt.close()
    assert ckpt.last_saved_step == 4
    assert sorted(os.listdir(root)) == ["step_0", "step_3", "step_4"]
    resumed = make_training(seed=9)
    again = CheckpointManager(root, every=3)
    assert again.restore(model=resumed[0], optimizer=resumed[1]) == 5  # nothing is repeated
    assert again.extra == {"at": 4}
    again.close()  # no maybe_save here: nothing more is saved
    assert all(torch.equal(v, final[k]) for k, v in resumed[0].state_dict().items())
    assert sorted(os.listdir(root)) == ["step_0", "step_3", "step_4"]


def test_with_block_saves_the_last_step_only_after_a_normal_end(tmp_path):
    model = Net()
    with CheckpointManager(tmp_path / "ok", every=10) as ckpt:
        for step in range(3):
            ckpt.maybe_save(step, model=model)
    assert find_latest_valid(tmp_path / "ok") == str(tmp_path / "ok" / "step_2")

    with pytest.raises(ZeroDivisionError), CheckpointManager(tmp_path / "bad", every=10) as ckpt:
        for step in range(3):
            ckpt.maybe_save(step, model=model)
        raise ZeroDivisionError("the state after a failure is not a finished step")
    assert find_latest_valid(tmp_path / "bad") == str(tmp_path / "bad" / "step_0")


def test_no_final_save_when_turned_off_or_already_saved(tmp_path, caplog):
    model = Net()
    with CheckpointManager(tmp_path / "off", every=10, save_on_close=False) as ckpt:
        for step in range(3):
            ckpt.maybe_save(step, model=model)
    assert sorted(os.listdir(tmp_path / "off")) == ["step_0"]

    ckpt = CheckpointManager(tmp_path / "due", every=2)
    for step in range(5):
        ckpt.maybe_save(step, model=model)
    with caplog.at_level("WARNING", logger="nbtools"):
        ckpt.close()
    assert sorted(os.listdir(tmp_path / "due")) == ["step_0", "step_2", "step_4"]
    assert "already exists" not in caplog.text

    ckpt = CheckpointManager(tmp_path / "explicit", every=10)
    ckpt.maybe_save(3, model=model)
    ckpt.save(7, model=model)  # newer than the last step seen by maybe_save
    ckpt.close()
    assert sorted(os.listdir(tmp_path / "explicit")) == ["step_7"]


def test_step_and_flag_types(tmp_path):
    with CheckpointManager(tmp_path / "c", every=2) as ckpt:
        with pytest.raises(TypeError, match="step must be an int"):
            ckpt.maybe_save("3", model=Net())
        with pytest.raises(ValueError, match="non-negative"):
            ckpt.save(-1, model=Net())
    with pytest.raises(TypeError, match="save_on_close must be a bool"):
        CheckpointManager(tmp_path / "c", save_on_close="no")
