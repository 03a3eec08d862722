"""Rank tracebacks regain the caller's file names and source lines."""

from __future__ import annotations

from nbtools.launch._sources import localizer


def _helper():
    raise ValueError("x")


def test_dynamic_code_frames_point_back_to_the_source():
    def train():
        return _helper()

    line = _helper.__code__.co_firstlineno + 1
    text = (
        "Traceback (most recent call last):\n"
        f'  File "<dynamic-code>", line {line}, in _helper\n'
        '  File "<dynamic-code>", line 99999, in unknown\n'
        "ValueError: x\n"
    )
    out = localizer(train)(text)
    assert f'File "{__file__}", line {line}, in _helper' in out
    assert 'raise ValueError("x")' in out
    assert '"<dynamic-code>", line 99999, in unknown' in out  # left alone when not found
    assert out.endswith("ValueError: x\n")


def test_stack_dump_frames_point_back_to_the_source():
    line = _helper.__code__.co_firstlineno + 1
    dump = f'  File "<dynamic-code>", line {line} in _helper'  # faulthandler's format
    out = localizer(_helper)(dump)
    assert out.splitlines() == [
        f'  File "{__file__}", line {line} in _helper',
        '    raise ValueError("x")',
    ]
