"""``emit`` in the kernel's own process: validation, stamping, the bus."""

from __future__ import annotations

import enum
import os
import subprocess
import sys
import uuid

import pytest

from nbtools import events
from nbtools.events import Bus, Event


def _kind() -> str:
    # The process bus is shared by every test of this session: each test reads its own kind.
    return "t" + uuid.uuid4().hex[:12]


def test_emit_in_the_kernel_reaches_the_bus_at_once():
    kind = _kind()
    seen: list[Event] = []
    events.subscribe(seen.extend)
    try:
        events.emit(kind, message="val loss 1.93", step=1200, value=1.93, split="val")
    finally:
        events.unsubscribe(seen.extend)
    (event,) = events.log(kinds=[kind])
    assert (event.kind, event.message, event.step) == (kind, "val loss 1.93", 1200)
    assert event.fields == {"value": 1.93, "split": "val"}
    assert (event.pid, event.rank) == (os.getpid(), None)
    assert event.host and event.time > 0
    assert seen == [event]
    events.emit(kind, message="after")
    assert len(seen) == 1, "an unsubscribed callback is not called again"


def test_rank_names_the_rank_an_event_is_about():
    kind = _kind()
    events.emit(kind, message="rank 3 failed", rank=3, reason="SIGKILL")
    (event,) = events.log(kinds=kind)
    assert event.rank == 3 and event.fields == {"reason": "SIGKILL"}


def test_numpy_scalars_become_python_numbers():
    np = pytest.importorskip("numpy")
    kind = _kind()
    events.emit(kind, step=np.int64(7), loss=np.float32(0.5), n=np.int32(3), ok=np.bool_(True))
    (event,) = events.log(kinds=kind)
    assert event.step == 7 and type(event.step) is int
    assert event.fields == {"loss": 0.5, "n": 3, "ok": True}
    assert [type(v) for v in event.fields.values()] == [float, int, bool]


def test_a_str_enum_is_a_kind():
    class Kind(str, enum.Enum):
        EVAL = "eval_" + uuid.uuid4().hex[:8]

    events.emit(Kind.EVAL)
    (event,) = events.log(kinds=[Kind.EVAL.value])
    assert type(event.kind) is str


def test_a_long_message_is_cut_not_refused():
    kind = _kind()
    events.emit(kind, message="x" * 5000)
    (event,) = events.log(kinds=kind)
    assert len(event.message) == 1000 and event.message.endswith("\u2026")


@pytest.mark.parametrize(
    "args, kwargs, error, words",
    [
        (("",), {}, ValueError, "non-empty"),
        (("   ",), {}, ValueError, "non-empty"),
        (("k" * 65,), {}, ValueError, "at most 64"),
        ((3,), {}, TypeError, "kind must be a str"),
        ((None,), {}, TypeError, "kind must be a str"),
        (("k",), {"message": 1.5}, TypeError, "put numbers in fields"),
        (("k",), {"value": [1, 2]}, TypeError, "'value' is a list"),
        (("k",), {"value": {"a": 1}}, TypeError, "numbers, booleans"),
        (("k",), {"value": object()}, TypeError, "numbers, booleans"),
        (("k",), {"step": 1.5}, TypeError, "step must be an int"),
        (("k",), {"step": True}, TypeError, "step must be an int"),
        (("k",), {"rank": "0"}, TypeError, "rank must be an int"),
        (("k",), {"time": 1.0}, ValueError, "reserved"),
        (("k",), {"host": "a"}, ValueError, "reserved"),
        (("k",), {"pid": 1}, ValueError, "reserved"),
        (("k",), {"note": "a" * 401}, ValueError, "in a file"),
        (("k",), {"big": 2**64}, ValueError, "64 bits"),
        (("k",), {f"f{i}": i for i in range(17)}, ValueError, "at most 16"),
    ],
)
def test_bad_input_is_refused_with_a_clear_error(args, kwargs, error, words):
    before = len(events.log())
    with pytest.raises(error, match=words):
        events.emit(*args, **kwargs)
    assert len(events.log()) == before, "a refused event is not recorded"


def test_a_tensor_field_is_refused_with_the_fix():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"loss\.item\(\)"):
        events.emit("k", loss=torch.tensor(1.0))


def test_flush_without_a_channel_is_a_no_op():
    assert events.flush(timeout=0.1) is True


def test_a_bad_channel_keeps_events_in_the_process(tmp_path):
    code = (
        "from nbtools import events\n"
        "events.emit('kept', x=1)\n"
        "print([e.kind for e in events.log()])\n"
    )
    env = dict(os.environ, NBTOOLS_EVENTS_CHANNEL="carrier-pigeon:/nowhere")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['kept']"
    assert "names no known transport" in out.stderr


def test_import_nbtools_then_events_attribute():
    code = (
        "import sys, nbtools\n"
        "assert 'nbtools.events' not in sys.modules\n"
        "nbtools.events.emit('x')\n"
        "assert 'torch' not in sys.modules\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr


# --- the bus -----------------------------------------------------------------


def _event(t: float, kind: str = "k") -> Event:
    return Event(t, "h", 0, 1, kind, None, None, {})


def test_bus_forgets_events_older_than_its_horizon():
    now = [1000.0]
    bus = Bus(max_age_s=60, clock=lambda: now[0])
    bus.publish([_event(950.0, "old"), _event(990.0, "new")])
    now[0] = 1015.0
    assert [e.kind for e in bus.log()] == ["new"]
    bus.publish_one(_event(1080.0, "later"))
    now[0] = 1080.0
    assert [e.kind for e in bus.log()] == ["later"]


def test_bus_keeps_at_most_max_events_newest_first_kept():
    bus = Bus(max_events=3, clock=lambda: 10.0)
    bus.publish([_event(float(i), f"k{i}") for i in range(5)])
    assert [e.kind for e in bus.log()] == ["k2", "k3", "k4"]


def test_bus_log_sorts_by_time_and_filters():
    bus = Bus(clock=lambda: 100.0)
    bus.publish([_event(3.0, "a"), _event(1.0, "b")])
    bus.publish([_event(2.0, "a")])
    assert [e.time for e in bus.log()] == [1.0, 2.0, 3.0]
    assert [e.time for e in bus.log(since=2.0, kinds=["a"])] == [2.0, 3.0]


def test_bus_counts_drops_per_process_and_tells_subscribers():
    bus = Bus(clock=lambda: 100.0)
    calls = []
    bus.subscribe(calls.append)
    bus.publish([], dropped=5, source=("h", 1, 11))
    bus.publish([_event(1.0)], dropped=2, source=("h", 1, 11))
    bus.publish([_event(1.0)], dropped=0, source=("h", 0, 10))
    assert bus.dropped() == 7
    assert bus.dropped_by_source() == {("h", 1, 11): 7}
    assert [len(c) for c in calls] == [0, 1, 1], "a drop-only report still reaches the pane"


def test_a_failing_subscriber_does_not_stop_delivery(caplog):
    bus = Bus(clock=lambda: 100.0)
    seen = []

    def broken(events):
        raise RuntimeError("bad pane")

    bus.subscribe(broken)
    bus.subscribe(seen.extend)
    bus.publish_one(_event(1.0))
    bus.publish_one(_event(2.0))
    assert len(seen) == 2 and len(bus) == 2


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"max_age_s": 0}, ValueError),
        ({"max_events": 0}, ValueError),
        ({"max_events": 1.5}, ValueError),
    ],
)
def test_bus_refuses_bad_bounds(kwargs, error):
    with pytest.raises(error):
        Bus(**kwargs)


def test_subscribe_needs_a_callable():
    with pytest.raises(TypeError, match="callable"):
        Bus().subscribe("pane")
