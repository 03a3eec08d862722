"""GPU pane: kernel CPU time and bytes sent to the front end per poll, against a naive redraw.

8 simulated GPUs with a full 2 h history (720 samples at 10 s) on screen. Each
poll of the pane (read, history, one small ``extendTraces`` message) is
compared with re-assigning all 24 traces of a plotly ``FigureWidget`` in one
``batch_update``. Comm messages are captured by a recording comm that
serialises them to JSON as the kernel would, so bytes are the bytes on the
wire and serialisation counts as CPU. Prints one JSON line.

Run: python benchmarks/monitor.py
"""

from __future__ import annotations

import json
import sys
import time
import tracemalloc

import comm as comm_package

from nbtools.monitor import GPUPane, History, Sample, SimulatedBackend, acquire, release

GPUS, INTERVAL, HISTORY, POLLS = 8, 10.0, 7200.0, 200


class _WireComm:
    """Records the bytes a kernel comm would send (JSON + binary buffers)."""

    kernel = "Truthy"
    count = 0

    def __init__(self, **kwargs):
        _WireComm.count += 1
        self.comm_id = kwargs.get("comm_id") or f"bench-{_WireComm.count}"
        self.sizes: list[int] = []
        self.open_bytes = self._size(kwargs.get("data"), kwargs.get("buffers"))

    @staticmethod
    def _size(data, buffers) -> int:
        body = json.dumps(data, separators=(",", ":"), default=str).encode()
        return len(body) + sum(memoryview(b).nbytes for b in buffers or [])

    def send(self, data=None, metadata=None, buffers=None):
        self.sizes.append(self._size(data, buffers))

    def on_msg(self, handler):
        pass

    def open(self, *args, **kwargs):
        pass

    def close(self, *args, **kwargs):
        pass


def _comms() -> list[_WireComm]:
    made: list[_WireComm] = []

    def create_comm(**kwargs):
        made.append(_WireComm(**kwargs))
        return made[-1]

    comm_package.create_comm = create_comm
    return made


class _Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def _fill(sampler, clock: _Clock) -> None:
    for _ in range(sampler.samples.capacity):
        clock.now += INTERVAL
        sampler.tick()


def measure_pane(comms: list[_WireComm]) -> dict:
    clock = _Clock()
    sampler = acquire(SimulatedBackend(GPUS), interval=INTERVAL, history_seconds=HISTORY,
                      idle_timeout=None, clock=clock, start=False)
    _fill(sampler, clock)
    first = len(comms)
    pane = GPUPane(backend=SimulatedBackend(GPUS), display=False)  # shares the sampler
    chart = next(c for c in comms[first:] if c.comm_id == pane._chart.comm.comm_id)
    plotly_js = len(pane._chart._plotly_js.encode())
    sent_before = sum(sum(c.sizes) for c in comms)
    cpu = time.process_time()
    for _ in range(POLLS):
        clock.now += INTERVAL
        sampler.tick()
    cpu = time.process_time() - cpu
    sent = sum(sum(c.sizes) for c in comms) - sent_before
    pane.close()
    release(sampler)
    return {
        "cpu_ms_per_poll": 1000 * cpu / POLLS,
        "bytes_per_poll": sent / POLLS,
        "open_bytes_without_plotly_js": chart.open_bytes - plotly_js,
        "plotly_js_bytes_once": plotly_js,
    }


def measure_naive(comms: list[_WireComm]) -> dict:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    backend, history = SimulatedBackend(GPUS), History(int(HISTORY / INTERVAL))
    now = 1_800_000_000.0
    fields = ("utilization", "memory_used", "temperature")

    def poll() -> None:
        nonlocal now
        now += INTERVAL
        history.add(Sample(backend.host, now, tuple(backend.read(now)), backend.source))

    for _ in range(history.capacity):
        poll()
    fig = go.FigureWidget(make_subplots(rows=3, cols=1, shared_xaxes=True))
    for panel in range(3):
        for index in range(GPUS):
            fig.add_scatter(row=panel + 1, col=1, mode="lines", name=f"GPU {index}")

    def redraw() -> None:
        with fig.batch_update():
            for panel, field in enumerate(fields):
                for index in range(GPUS):
                    times, values = history.series(backend.host, index, field)
                    trace = fig.data[panel * GPUS + index]
                    trace.x = [t * 1000 for t in times.tolist()]
                    trace.y = values.tolist()

    redraw()
    sent_before = sum(sum(c.sizes) for c in comms)
    polls = POLLS // 10  # the naive redraw is slow; fewer polls measure it well enough
    cpu = time.process_time()
    for _ in range(polls):
        poll()
        redraw()
    cpu = time.process_time() - cpu
    sent = sum(sum(c.sizes) for c in comms) - sent_before
    fig.close()
    return {"cpu_ms_per_poll": 1000 * cpu / polls, "bytes_per_poll": sent / polls}


def measure_memory() -> dict:
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    clock = _Clock()
    sampler = acquire(SimulatedBackend(GPUS), interval=INTERVAL, history_seconds=HISTORY,
                      idle_timeout=None, clock=clock, start=False)
    _fill(sampler, clock)
    full = tracemalloc.get_traced_memory()[0] - base
    _fill(sampler, clock)  # another two hours: memory must not grow
    again = tracemalloc.get_traced_memory()[0] - base
    ring = sampler.samples.nbytes
    release(sampler)
    tracemalloc.stop()
    return {"history_ring_bytes": ring, "history_traced_bytes_2h": full,
            "history_traced_bytes_4h": again}


def main() -> None:
    comms = _comms()
    pane = measure_pane(comms)
    naive = measure_naive(comms)
    memory = measure_memory()
    result = {
        "benchmark": "monitor",
        "gpus": GPUS,
        "history_points": int(HISTORY / INTERVAL),
        "pane_cpu_ms_per_poll": round(pane["cpu_ms_per_poll"], 3),
        "pane_bytes_per_poll": round(pane["bytes_per_poll"]),
        "naive_cpu_ms_per_poll": round(naive["cpu_ms_per_poll"], 2),
        "naive_bytes_per_poll": round(naive["bytes_per_poll"]),
        "bytes_ratio": round(naive["bytes_per_poll"] / pane["bytes_per_poll"], 1),
        "cpu_ratio": round(naive["cpu_ms_per_poll"] / pane["cpu_ms_per_poll"], 1),
        "pane_open_bytes_without_plotly_js": pane["open_bytes_without_plotly_js"],
        "plotly_js_bytes_once_per_pane": pane["plotly_js_bytes_once"],
        **memory,
        "goal_met": pane["cpu_ms_per_poll"] <= 2.0 and pane["bytes_per_poll"] <= 4096
        and naive["bytes_per_poll"] >= 100 * pane["bytes_per_poll"],
        "python": sys.version.split()[0],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
