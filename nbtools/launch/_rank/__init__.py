"""What runs inside a rank: its set-up, the call of the user's function, and its end.

Every rank enters through :func:`enter_rank` (threads, device, logging, displays,
trainer hooks, the guards, then the unpickled function), whichever backend
started it: the local backend's elastic worker (:func:`run_rank`, through which
the pool's ranks start too) and the Ray actor alike. The rest of ``launch/``
uses what this door exports:

- ``_inrank``: :func:`enter_rank` and the guards it installs; :func:`in_rank`;
- ``_worker``: :func:`run_rank`, the local backend's rank, and the files by
  which it talks to the caller (:class:`RankSpec`, ``*_path``);
- ``_records``: the failure record a rank publishes;
- ``_heal``: a rank whose peer died waits for the caller's verdict and forms the
  group again in its next generation (``@distributed(heal=True)``);
- ``_display`` (with ``_display_mpl``) and ``_kernel_logging``: the cell's rich
  output and the kernel's logging, in the rank;
- ``_trainer_hooks``: HF and Lightning trainers report their steps;
- ``_rank_exit``: what the rank's code registered for interpreter exit runs at its end;
- ``_leftovers``: the processes a rank leaves behind, found and ended.

Start reading at ``_inrank.enter_rank``, then ``_worker.run_rank``.
"""

from __future__ import annotations

from nbtools.launch._rank._display import MARK as DISPLAY_MARK
from nbtools.launch._rank._display import RICH_OUTPUT_MODES, figure_bundle
from nbtools.launch._rank._display import show as show_display
from nbtools.launch._rank._heal import (
    GENERATION_ENV,
    REPLACED_ENV,
    generation_formed_path,
    grow_path,
    heal_environment,
    rank_variables,
    started_path,
    store_path,
    waiting_path,
    write_verdict,
)
from nbtools.launch._rank._inrank import (
    RESULTS_DEVICES,
    bind_to,
    enter_rank,
    in_rank,
    pickle_main_by_value,
    setup_environment,
)
from nbtools.launch._rank._kernel_logging import ENV as KERNEL_LOGGING_ENV
from nbtools.launch._rank._kernel_logging import apply as apply_kernel_logging
from nbtools.launch._rank._kernel_logging import describe as describe_kernel_logging
from nbtools.launch._rank._leftovers import (
    await_ending,
    end_groups,
    end_rank_leftovers,
    ending,
    exit_code,
    is_library_service,
    lead_own_group,
    runs_own_code,
)
from nbtools.launch._rank._records import GROUP_PHASE, failure_record, flush_events
from nbtools.launch._rank._worker import (
    STACK_SIGNAL,
    RankSpec,
    failure_path,
    formed_path,
    leftovers_path,
    release_path,
    returned_path,
    run_rank,
)

__all__ = [
    "enter_rank",
    "in_rank",
    "setup_environment",
    "bind_to",
    "pickle_main_by_value",
    "run_rank",
    "RankSpec",
    "STACK_SIGNAL",
    "failure_path",
    "formed_path",
    "leftovers_path",
    "release_path",
    "returned_path",
    "GENERATION_ENV",
    "REPLACED_ENV",
    "generation_formed_path",
    "grow_path",
    "heal_environment",
    "rank_variables",
    "started_path",
    "store_path",
    "waiting_path",
    "write_verdict",
    "GROUP_PHASE",
    "failure_record",
    "flush_events",
    "DISPLAY_MARK",
    "RICH_OUTPUT_MODES",
    "RESULTS_DEVICES",
    "figure_bundle",
    "show_display",
    "KERNEL_LOGGING_ENV",
    "apply_kernel_logging",
    "describe_kernel_logging",
    "await_ending",
    "end_groups",
    "end_rank_leftovers",
    "ending",
    "runs_own_code",
    "exit_code",
    "is_library_service",
    "lead_own_group",
]
