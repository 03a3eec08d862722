"""Sampler scheduling, idle pause, history bound and sharing, driven by a fake clock."""

from __future__ import annotations

import threading

import pytest

from nbtools.errors import MonitorError
from nbtools.monitor import NVMLBackend, Sample, Sampler, SimulatedBackend, acquire, release
from nbtools.monitor.sampler import THREAD_NAME


def sampler_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME and t.is_alive()]


@pytest.fixture
def make(clock):
    made: list[Sampler] = []

    def build(num_gpus: int = 2, **options) -> Sampler:
        options.setdefault("clock", clock)
        options.setdefault("start", False)
        made.append(Sampler(SimulatedBackend(num_gpus), **options))
        return made[-1]

    yield build
    for sampler in made:
        sampler.close()


def test_polls_once_per_interval(make, clock):
    sampler = make(interval=10, idle_timeout=None)
    times = []
    sampler.add_sink(lambda s: times.append(s.time))
    start = clock.now
    assert sampler.tick() == 10  # first poll at once, next one in 10 s
    clock.advance(4)
    assert sampler.tick() == 6  # not due: nothing read
    clock.advance(6)
    sampler.tick()
    clock.advance(10)
    sampler.tick()
    assert times == [start, start + 10, start + 20]
    assert sampler.last_sample.time == start + 20
    assert sampler.last_sample.source == "simulated" and sampler.simulated


def test_history_is_bounded_by_seconds_over_interval(make, clock):
    sampler = make(num_gpus=3, interval=10, history_seconds=60, idle_timeout=None)
    assert sampler.samples.capacity == 7
    for _ in range(7):
        sampler.tick()
        clock.advance(10)
    full = sampler.samples.nbytes
    for _ in range(500):
        sampler.tick()
        clock.advance(10)
    assert len(sampler.samples) == 7
    assert sampler.samples.nbytes == full  # memory does not grow with uptime
    times = sorted(set(sampler.samples.columns()["time"]))
    assert times == [clock.now - 10 * k for k in range(7, 0, -1)]


def test_pauses_when_idle_and_any_activity_resumes(make, clock):
    sampler = make(interval=10, idle_timeout=300)
    statuses = []
    sampler.add_watcher(lambda status, message: statuses.append((status, message)))
    sampler.tick()
    clock.advance(290)
    # The next tick is scheduled for the idle deadline, not later.
    assert sampler.tick() == pytest.approx(10)
    clock.advance(10)
    polls = len(sampler.samples)
    sampler.tick()
    assert sampler.status == "paused" and sampler.paused_reason == "idle"
    assert "no cell has run" in sampler.message and "5 min" in sampler.message
    clock.advance(3600)
    sampler.tick()
    assert len(sampler.samples) == polls  # nothing polled while paused
    sampler.touch()  # a cell ran or the pane was used
    assert sampler.status == "polling"
    sampler.tick()
    assert len(sampler.samples) == polls + 1
    assert [s for s, _ in statuses] == ["paused", "polling"]


def test_a_long_running_cell_keeps_polling(make, clock):
    sampler = make(interval=10, idle_timeout=300)
    sampler.set_busy(True)  # pre_run_cell of a training cell
    for _ in range(360):  # one hour of training
        sampler.tick()
        clock.advance(10)
    assert sampler.status == "polling"
    assert len(sampler.samples) == 360
    sampler.set_busy(False)  # post_run_cell
    clock.advance(300)
    sampler.tick()
    assert sampler.status == "paused"


def test_refresh_samples_now_and_resumes_an_idle_pause(make, clock):
    sampler = make(interval=10, idle_timeout=60)
    sampler.tick()
    clock.advance(61)
    sampler.tick()
    assert sampler.status == "paused"
    clock.advance(1)
    sample = sampler.refresh()
    assert sample.time == clock.now and sampler.last_sample is sample
    assert sampler.status == "polling"


def test_user_pause_survives_activity_until_resume(make, clock):
    sampler = make(interval=10, idle_timeout=60)
    sampler.tick()
    sampler.pause()
    assert sampler.status == "paused" and sampler.paused_reason == "user"
    sampler.touch()
    clock.advance(100)
    sampler.tick()
    assert sampler.status == "paused" and len(sampler.samples) == 1
    sampler.refresh()  # still answers an explicit refresh
    assert len(sampler.samples) == 2 and sampler.status == "paused"
    sampler.resume()
    sampler.tick()
    assert sampler.status == "polling" and len(sampler.samples) == 3


def test_unavailable_backend_is_a_state_not_an_exception(fake_pynvml, clock):
    fake_pynvml([], init_error="NVMLError_LibraryNotFound")
    sampler = Sampler(NVMLBackend(), clock=clock)  # start=True: still no thread
    try:
        assert sampler.status == "unavailable"
        assert "no NVIDIA driver found" in sampler.message
        assert sampler_threads() == []
        assert sampler.refresh() is None and sampler.tick() > 0
        sampler.resume()
        assert sampler.status == "unavailable"
    finally:
        sampler.close()
    assert sampler.status == "closed"
    with pytest.raises(MonitorError, match="create a new GPUPane"):
        sampler.refresh()


def test_a_backend_failing_mid_run_becomes_unavailable(make, clock):
    sampler = make()

    def broken(now: float):
        raise OSError("device vanished")

    sampler.backend.read = broken
    assert sampler.refresh() is None
    assert sampler.status == "unavailable" and "device vanished" in sampler.message


def test_sinks_get_every_sample_and_a_failing_sink_is_isolated(make, clock, caplog):
    sampler = make(idle_timeout=None)
    seen: list[Sample] = []

    def bad(sample: Sample) -> None:
        raise RuntimeError("tracking server down")

    sampler.add_sink(bad)
    sampler.add_sink(seen.append)
    sampler.tick()
    clock.advance(10)
    sampler.tick()
    assert len(seen) == 2
    failures = [r for r in caplog.records if "stays registered" in r.getMessage()]
    assert len(failures) == 1  # logged once, not at every poll
    sampler.remove_sink(seen.append)
    sampler.refresh()
    assert len(seen) == 2


def test_samples_from_other_hosts_are_grouped_by_host(make, clock):
    sampler = make(num_gpus=2, idle_timeout=None)
    sampler.tick()
    remote = SimulatedBackend(3, host="node1", seed=1)
    sampler.ingest(Sample("node1", clock.now, tuple(remote.read(clock.now)), "simulated"))
    assert sampler.samples.hosts() == ["simulated", "node1"]
    assert [(h, i) for h, i, _ in sampler.samples.gpus()] == [
        ("simulated", 0),
        ("simulated", 1),
        ("node1", 0),
        ("node1", 1),
        ("node1", 2),
    ]
    with pytest.raises(TypeError, match="Sample"):
        sampler.ingest({"host": "x"})


def test_thread_polls_in_background_and_close_stops_it():
    sampler = Sampler(SimulatedBackend(2), interval=0.01, history_seconds=1)
    got = threading.Event()
    sampler.add_sink(lambda s: got.set())
    try:
        assert got.wait(timeout=30), "the sampler thread took no sample"
        assert [t.name for t in sampler_threads()] == [THREAD_NAME]
    finally:
        sampler.close()
    assert sampler_threads() == []
    sampler.close()  # idempotent


def test_one_sampler_per_backend_key():
    first = acquire(SimulatedBackend(4), interval=5, history_seconds=60)
    second = acquire(SimulatedBackend(4), interval=1, history_seconds=60)  # same GPUs
    other = acquire(SimulatedBackend(4, host="node1"), history_seconds=60)
    try:
        assert second is first and first.interval == 5
        assert other is not first
        assert len(sampler_threads()) == 2
        release(second)
        assert first.status != "closed"
    finally:
        release(first)
        release(other)
    assert first.status == "closed" and other.status == "closed"
    assert sampler_threads() == []


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"interval": 0}, "interval must be at least 0.01 s"),
        ({"interval": 10, "history_seconds": 5}, "history must be at least interval"),
        ({"idle_timeout": -1}, "idle_timeout must be"),
    ],
)
def test_bad_options_say_what_to_do(options, match):
    with pytest.raises(ValueError, match=match):
        Sampler(SimulatedBackend(1), start=False, **options)


def test_backend_must_follow_the_protocol():
    with pytest.raises(TypeError, match="backend must provide"):
        Sampler(object(), start=False)
