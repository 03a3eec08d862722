"""Training-timeline events: caller cost, delivery latency, behaviour under a flood.

Prints one JSON line. Run: ``python benchmarks/events.py``.

- Caller cost of ``events.emit`` in a rank (a child process with the channel
  the launcher would give it), timed call by call, against an empty function
  of the same signature and ``logging.info`` to a handler, in the same process.
  Calls come in rounds of 1,000 with 10 ms between rounds, as a training loop
  has work between its events; a tight-loop figure is given too.
- Delivery latency from 2 ranks emitting 1,000 events/s each to the kernel's
  bus (event time stamp to arrival), p50/p99.
- A rank emitting 1,000,000 events in a tight loop: its loop time against the
  same loop calling an empty function, events delivered and dropped, memory.
- Bytes of each GPU-pane update while a busy run's events arrive (about 5 per
  poll, and a burst of 2,000), and the bytes a second pane opens with
  (``benchmarks/monitor.py`` measures these; the goal is 4 KB per update).
"""

from __future__ import annotations

import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import time

ROUNDS, PER_ROUND, PAUSE_S = 100, 1000, 0.01
TIGHT = 200_000
RATE_HZ, RATE_S, RATE_RANKS = 1000, 5.0, 2
FLOOD = 1_000_000


def _empty(kind, message=None, **fields):
    return None


def _stats(samples: list[int]) -> dict[str, float]:
    samples = sorted(samples)
    return {
        "mean_ns": round(statistics.fmean(samples), 1),
        "p99_ns": samples[int(0.99 * (len(samples) - 1))],
    }


def _timed(call) -> list[int]:
    clock = time.perf_counter_ns
    out: list[int] = []
    for _ in range(ROUNDS):
        for i in range(PER_ROUND):
            start = clock()
            call("eval", "val loss", step=i, value=1.93)
            out.append(clock() - start)
        time.sleep(PAUSE_S)
    return out


def _tight(call, n: int) -> float:
    start = time.perf_counter()
    for i in range(n):
        call("eval", "val loss", step=i, value=1.93)
    return time.perf_counter() - start


def child_cost() -> dict:
    from nbtools import events

    log = logging.getLogger("bench.events")
    log.propagate = False
    log.setLevel(logging.INFO)
    log.addHandler(logging.StreamHandler(open(os.devnull, "w")))

    def log_info(kind, message=None, step=None, value=None):
        log.info("%s %s step=%s value=%s", kind, message, step, value)

    events.emit("warm")
    out = {}
    for name, call in (("empty", _empty), ("logging", log_info), ("emit", events.emit)):
        out[name] = _stats(_timed(call))
        events.flush(30)
    out["tight_empty_ns"] = round(_tight(_empty, TIGHT) / TIGHT * 1e9, 1)
    out["tight_emit_ns"] = round(_tight(events.emit, TIGHT) / TIGHT * 1e9, 1)
    return out


def child_rate() -> dict:
    from nbtools import events

    period = 1.0 / RATE_HZ
    start = time.perf_counter()
    for i in range(int(RATE_HZ * RATE_S)):
        delay = start + i * period - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        events.emit("latency", step=i)
    return {}


def child_flood() -> dict:
    from nbtools import events

    events.emit("warm")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    empty_s = _tight(_empty, FLOOD)
    emit_s = _tight(events.emit, FLOOD)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    return {
        "empty_s": round(empty_s, 3),
        "emit_s": round(emit_s, 3),
        "rss_growth_mib": round(grown / 1024, 1),
    }


def _start(mode: str, env: dict[str, str], rank: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, __file__, "--child", mode],
        env=dict(os.environ, **env, RANK=str(rank)),
        stdout=subprocess.PIPE,
        text=True,
    )


def _result(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"benchmark child failed with exit code {proc.returncode}")
    return json.loads(out.strip().splitlines()[-1])


def _pane_bytes() -> dict:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import monitor  # benchmarks/monitor.py

    comms = monitor._comms()
    measured = monitor.measure_events(comms)
    return {
        "pane_events_per_update": measured["events_per_poll"],
        "pane_bytes_per_update_with_events_mean": round(measured["mean"]),
        "pane_bytes_per_update_with_events_max": measured["max"],
        "pane_bytes_per_update_burst_max": measured["burst_max"],
    }


def main() -> None:
    from nbtools.events import Bus, Collector

    bus = Bus(max_events=2_000_000)
    latencies: list[float] = []
    counts = {"delivered": 0}

    def on_events(batch):
        now = time.time()
        counts["delivered"] += len(batch)
        latencies.extend(now - e.time for e in batch if e.kind == "latency")

    bus.subscribe(on_events)
    with Collector(bus=bus) as collector:
        env = collector.environment()
        cost = _result(_start("cost", env, 0))
        collector.drain()
        cost_dropped = bus.dropped()
        latencies.clear()

        ranks = [_start("rate", env, r) for r in range(RATE_RANKS)]
        for proc in ranks:
            _result(proc)
        collector.drain()
        lat = sorted(latencies)
        rate_dropped = bus.dropped() - cost_dropped

        counts["delivered"] = 0
        flood = _result(_start("flood", env, 0))
        collector.drain()
        flood_dropped = bus.dropped() - rate_dropped - cost_dropped
    pane = _pane_bytes()
    print(
        json.dumps(
            {
                "benchmark": "events",
                "emit_mean_ns": cost["emit"]["mean_ns"],
                "emit_p99_ns": cost["emit"]["p99_ns"],
                "empty_call_mean_ns": cost["empty"]["mean_ns"],
                "empty_call_p99_ns": cost["empty"]["p99_ns"],
                "logging_info_mean_ns": cost["logging"]["mean_ns"],
                "logging_info_p99_ns": cost["logging"]["p99_ns"],
                "emit_over_logging": round(cost["emit"]["mean_ns"] / cost["logging"]["mean_ns"], 2),
                "tight_loop_emit_ns": cost["tight_emit_ns"],
                "tight_loop_empty_ns": cost["tight_empty_ns"],
                "latency_ranks": RATE_RANKS,
                "latency_events_per_s_per_rank": RATE_HZ,
                "latency_events": len(lat),
                "latency_dropped": rate_dropped,
                "latency_p50_ms": round(1e3 * lat[len(lat) // 2], 2) if lat else None,
                "latency_p99_ms": round(1e3 * lat[int(0.99 * (len(lat) - 1))], 2) if lat else None,
                "flood_events": FLOOD,
                "flood_delivered": counts["delivered"],
                "flood_dropped": flood_dropped,
                "flood_loop_s": flood["emit_s"],
                "flood_empty_loop_s": flood["empty_s"],
                "flood_rss_growth_mib": flood["rss_growth_mib"],
                "goal_emit_mean_le_5us": cost["emit"]["mean_ns"] <= 5000,
                "goal_latency_p99_le_1s": bool(lat) and lat[int(0.99 * (len(lat) - 1))] <= 1.0,
                **pane,
                "goal_pane_update_le_4kb": max(
                    pane["pane_bytes_per_update_with_events_max"],
                    pane["pane_bytes_per_update_burst_max"],
                )
                <= 4096,
                "cpus": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        result = {"cost": child_cost, "rate": child_rate, "flood": child_flood}[sys.argv[2]]()
        print(json.dumps(result), flush=True)
    else:
        main()
