"""Hangs and stragglers: the kernel's watch over a running group of ranks.

The launcher opens a :class:`Watchdog` for each group it runs. It reads the
ranks' progress reports from the events bus, samples each local rank's
process from outside, and flags a rank that stopped (a hang, with a
:class:`HangReport` for the cell) or that runs behind the others (a
straggler, as ``straggler`` events and one line each for the cell). What
happens next is the launcher's policy, not this room's.

The room, module by module:

- ``_watchdog``: the :class:`Watchdog`: reads the reports, samples the ranks,
  judges when a rank is hung.
- ``_state``: one rank as the watchdog knows it, an open flag, whether a
  rank is busy, and the first steps a run showed (kept across its attempts).
- ``_flags``: the open flags, the cell's lines and the events not yet emitted.
- ``_stragglers``: straggler scores from the time outside collectives.
- ``_process``: what a rank's process is doing, read from outside it (/proc,
  py-spy).
- ``_collectives``: which collective each rank is in (torch's Flight Recorder,
  asked through the events channel), in words.
- ``_report``: the :class:`HangReport`: its culprits, headline and stacks, and
  the ``hang`` events.

It sits at the base layer, beside :mod:`nbtools.events`: it imports only the
standard library, ``nbtools._internal`` and ``nbtools.events``.
"""

from __future__ import annotations

from nbtools._hangs._report import Culprit, HangReport
from nbtools._hangs._state import FirstSteps
from nbtools._hangs._watchdog import Flag, Watchdog

__all__ = ["Culprit", "FirstSteps", "Flag", "HangReport", "Watchdog"]
