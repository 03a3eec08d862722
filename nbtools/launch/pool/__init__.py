"""Persistent ranks: :class:`RankPool`, ``%distributed`` and ``@distributed(keep_alive=True)``.

The pool sits above the backend seam, beside the plain call
(:mod:`nbtools.launch._runner`): its ranks are an ordinary group of the launch
backend whose function is a command loop. One room per concern:

- :mod:`._pool`: ``RankPool``, the calls a user makes;
- :mod:`._restarts`: how a pool starts, restarts, heals in place and gives up;
- :mod:`._ranks`: one generation of ranks, commanded and watched from the kernel;
- :mod:`._waits`: how a wait on the ranks ends (lost, healed, stuck, hung,
  interrupted), and the call's watchdog;
- :mod:`._rank`: what a pool rank runs (the command loop over its namespace);
- :mod:`._channel`: the authenticated command channel between the two;
- :mod:`._errors`: how a call's failures read in the notebook;
- :mod:`._registry`: which pools this process holds, one call at a time on each;
- :mod:`._kept`: one pool per ``@distributed(keep_alive=True)`` configuration.

Example:
    >>> from nbtools.launch import RankPool
    >>> with RankPool(processes=2) as pool:  # doctest: +SKIP
    ...     pool.run(lambda: 1)
    [1, 1]
"""

from __future__ import annotations

from nbtools.launch.pool._kept import call_kept
from nbtools.launch.pool._pool import RankPool
from nbtools.launch.pool._registry import shutdown

__all__ = ["RankPool", "call_kept", "shutdown"]
