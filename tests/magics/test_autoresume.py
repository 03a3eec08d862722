"""``%%autoresume`` in IPython's shell, with the real CheckpointManager and torch."""

from __future__ import annotations

import os
import signal

import pytest

checkpoint_pkg = pytest.importorskip("nbtools.checkpoint")
if not hasattr(checkpoint_pkg, "CheckpointManager"):  # pragma: no cover - not built yet
    pytest.skip("nbtools.checkpoint has no CheckpointManager yet", allow_module_level=True)
torch = pytest.importorskip("torch")

SETUP = """
import torch
torch.manual_seed({seed})
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
x = torch.linspace(-1, 1, 32).reshape(8, 4)
ran = []
"""

# Line 1 of a cell is the magic line; the body's lines keep their numbers in tracebacks.
BODY = """
for step in range(start_step, 10):
    if step == stop_at:
        raise stop_with
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    ran.append(step)
    checkpoint(step)
"""
RAISE_LINE = 4


def _uninterrupted_weights() -> torch.Tensor:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.linspace(-1, 1, 32).reshape(8, 4)
    for _ in range(10):
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.weight.detach().clone()


def _setup(ip, seed=0, stop_at=None, stop_with="KeyboardInterrupt"):
    result = ip.run_cell(
        SETUP.format(seed=seed) + f"\nstop_at = {stop_at!r}\nstop_with = {stop_with}\n"
    )
    assert result.success, result.error_in_exec


def _autoresume(ip, root, args="--every 3 --state model,optimizer", body=BODY):
    return ip.run_cell(f"%%autoresume {root} {args}" + body)


def test_a_fresh_run_saves_and_running_the_cell_again_continues(ip, tmp_path, capsys):
    root = tmp_path / "ckpt"
    _setup(ip)
    # A trailing comment on the magic line is a comment, as on IPython's own magics.
    result = _autoresume(ip, root, args="--every 3 --state model,optimizer   # every 3 steps")
    assert result.success, result.error_in_exec
    out = capsys.readouterr().out
    assert f"no checkpoint under {root}; starting fresh with start_step = 0" in out
    # The last step is saved on a normal end, and a loop that ended says so.
    assert f"the cell finished; last saved step 9 under {root}" in out
    assert "run the cell again" not in out
    assert ip.user_ns["ran"] == list(range(10))
    assert checkpoint_pkg.find_latest_valid(str(root)) is not None

    _setup(ip, seed=1)  # new objects, as after a kernel restart
    result = _autoresume(ip, root)
    assert result.success, result.error_in_exec
    out = capsys.readouterr().out
    assert f"restored step 9 from {root} into model, optimizer; start_step = 10" in out
    assert ip.user_ns["start_step"] == 10 and ip.user_ns["ran"] == []
    assert torch.equal(ip.user_ns["model"].weight, _uninterrupted_weights())
    from nbtools.errors import CheckpointError

    with pytest.raises(CheckpointError, match="has finished"):  # an nbtools error, not bare
        ip.user_ns["checkpoint"](10)


def test_an_interrupted_cell_completes_its_save_and_resumes_to_the_same_result(
    ip, tmp_path, capsys
):
    root = tmp_path / "ckpt"
    _setup(ip, stop_at=7)
    result = _autoresume(ip, root)
    assert isinstance(result.error_in_exec, KeyboardInterrupt)
    out = capsys.readouterr().out
    assert f"last saved step 6 under {root}; run the cell again to continue" in out
    assert checkpoint_pkg.find_latest_valid(str(root)).rstrip("/").endswith("step_6")

    _setup(ip, seed=1)  # the restored state, not what is in memory, decides the result
    result = _autoresume(ip, root)
    assert result.success, result.error_in_exec
    assert "restored step 6" in capsys.readouterr().out
    assert ip.user_ns["ran"] == [7, 8, 9]
    assert torch.equal(ip.user_ns["model"].weight, _uninterrupted_weights())


def test_an_exception_keeps_its_traceback_and_the_last_checkpoint(ip, tmp_path, capsys):
    root = tmp_path / "ckpt"
    _setup(ip, stop_at=5, stop_with="ValueError('diverged')")
    result = _autoresume(ip, root)
    error = result.error_in_exec
    assert isinstance(error, ValueError) and str(error) == "diverged"
    captured = capsys.readouterr()
    assert f"last saved step 3 under {root}" in captured.out
    tb = error.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    assert tb.tb_lineno == RAISE_LINE  # counted in the cell as the user sees it
    assert "raise stop_with" in captured.err + captured.out  # the cell's line is shown
    assert checkpoint_pkg.find_latest_valid(str(root)).rstrip("/").endswith("step_3")


def test_default_state_keep_and_the_last_expression_as_output(ip, tmp_path, capsys):
    _setup(ip)
    root = tmp_path / "ckpt"
    result = _autoresume(ip, root, args="--every 2 --keep 2", body=BODY + "start_step + 100\n")
    assert result.success, result.error_in_exec
    assert result.result == 100
    assert "(state: model, optimizer)" in capsys.readouterr().out
    assert sorted(p.name for p in root.glob("step_*")) == ["step_8", "step_9"]  # --keep 2


@pytest.mark.parametrize(
    ("args", "body", "message"),
    [
        ("ROOT --state model,nosuch", BODY, "no object named 'nosuch' in the notebook"),
        ("ROOT --state model,x", BODY, "'x' (Tensor) has no state_dict()/load_state_dict()"),
        ("FILE/ckpt --state model", BODY, "cannot create ROOT"),
        ("ROOT --every 0", BODY, "invalid positive integer value: '0'"),
        ("--every 3", BODY, "the following arguments are required: ROOT"),
        ("ROOT --state optimizer", BODY, "optimizer 'optimizer' optimizes no parameter"),
        ("ROOT", "\n\n", "the cell has no body"),
        ("ROOT --cluster ray", BODY, "unrecognized arguments: --cluster ray"),
    ],
    ids=[
        "unknown-name",
        "not-stateful",
        "root-not-writable",
        "bad-every",
        "no-root",
        "optimizer-without-model",
        "empty-body",
        "cluster",  # the cell runs in this kernel; ranks on Ray use CheckpointManager
    ],
)
def test_argument_errors_are_one_clear_line(ip, tmp_path, capsys, args, body, message):
    from IPython.core.error import UsageError

    (tmp_path / "a_file").write_text("not a directory")
    _setup(ip)
    args = args.replace("ROOT", str(tmp_path / "ckpt")).replace("FILE", str(tmp_path / "a_file"))
    result = ip.run_cell(f"%%autoresume {args}" + body)
    assert isinstance(result.error_in_exec, UsageError)
    captured = capsys.readouterr()
    lines = [line for line in (captured.err + captured.out).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("UsageError: ") and message in lines[0], lines
    assert ip.user_ns["ran"] == []


def test_every_option_the_magic_parses_reaches_the_run():
    """An option parsed and then dropped would be accepted and do nothing."""
    import dataclasses

    from nbtools._magics.autoresume import AutoresumeOptions
    from nbtools.magics import NbtoolsMagics

    parser = NbtoolsMagics.autoresume.parser
    parsed = {action.dest for action in parser._actions} - {"help"}
    assert parsed == {field.name for field in dataclasses.fields(AutoresumeOptions)}


def test_a_loader_without_a_position_is_named_before_anything_runs(ip, tmp_path, capsys):
    from IPython.core.error import UsageError

    _setup(ip)
    made = ip.run_cell(
        "from torch.utils.data import TensorDataset\n"
        "from nbtools.data import DataLoader\n"
        "loader = DataLoader(TensorDataset(x), batch_size=4, num_workers=0)"
    )
    assert made.success, made.error_in_exec
    root = tmp_path / "ckpt"
    result = _autoresume(ip, root, args="--every 3 --state model,optimizer,loader")
    assert isinstance(result.error_in_exec, UsageError)
    message = str(result.error_in_exec)
    assert "'loader' is a DataLoader over a TensorDataset, which has no position to save" in message
    assert "remove 'loader' from --state" in message and "VolumeDataset" in message
    assert ip.user_ns["ran"] == [] and not root.exists()  # nothing ran, nothing was written
    capsys.readouterr()

    # Without --state every stateful object is saved: the loader is left out, and told.
    result = _autoresume(ip, root, args="--every 3")
    assert result.success, result.error_in_exec
    out = capsys.readouterr().out
    assert "leaving out loader (a DataLoader over a TensorDataset" in out
    assert "(state: model, optimizer)" in out and ip.user_ns["ran"] == list(range(10))


def test_one_interrupt_is_held_back_while_a_checkpoint_is_completed_and_a_second_is_obeyed(capsys):
    from nbtools._magics.autoresume import _interrupts_deferred

    before = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a kernel
    try:
        with _interrupts_deferred() as deferred:
            os.kill(os.getpid(), signal.SIGINT)  # held back: the save in flight must finish
            assert deferred == [True]
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)  # the user insists
        after = signal.getsignal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, before)
    assert after is signal.default_int_handler
    assert "interrupt again to abandon it" in capsys.readouterr().out


def test_reports_are_display_output_not_prints(ip, tmp_path):
    from IPython.utils.capture import capture_output

    root = tmp_path / "ckpt"
    _setup(ip)
    with capture_output() as captured:
        result = _autoresume(ip, root)
    assert result.success, result.error_in_exec
    shown = "\n".join(out.data.get("text/plain", "") for out in captured.outputs)
    assert f"autoresume: no checkpoint under {root}; starting fresh" in shown
    assert f"autoresume: the cell finished; last saved step 9 under {root}" in shown
    assert "autoresume" not in captured.stdout


def test_the_last_step_is_saved_once(ip, tmp_path, caplog):
    import logging

    root = tmp_path / "ckpt"
    _setup(ip)
    with caplog.at_level(logging.INFO, logger="nbtools.checkpoint"):
        result = _autoresume(ip, root, args="--every 4 --state model,optimizer")
    assert result.success, result.error_in_exec
    assert "already exists" not in caplog.text  # what a second save of step 9 would log
    assert sorted(p.name for p in root.iterdir()) == ["step_0", "step_4", "step_8", "step_9"]


def test_the_body_is_named_after_its_own_cell(ip, tmp_path):
    _setup(ip, stop_at=2, stop_with="ValueError('diverged')")
    for _ in range(2):  # numbered cells before it, as in a notebook
        ip.run_cell("pass", store_history=True)
    result = ip.run_cell(f"%%autoresume {tmp_path / 'ckpt'} --every 3" + BODY, store_history=True)
    tb = result.error_in_exec.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    # IPython shows a file of its cache as "Cell In[N]" through this map.
    assert ip.compile._filename_map[tb.tb_frame.f_code.co_filename] == result.execution_count
