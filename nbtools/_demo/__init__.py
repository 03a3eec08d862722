"""The resilient-training demo behind ``python -m nbtools demo`` and notebook 02.

Two ranks train a small MLP in DDP on sample files read through
``VolumeDataset``/``DataLoader``, checkpoint asynchronously with
``CheckpointManager`` and log the loss to MLflow; on the first attempt one rank
SIGKILLs itself, ``@distributed(max_restarts=2)`` restarts the group, and the
run finishes from the newest checkpoint. The result is compared with an
uninterrupted run of the same length.
"""

from __future__ import annotations

from nbtools._demo.cli import DemoOutcome, report, run_demo, run_pair
from nbtools._demo.history import (
    continuity_problems,
    effective_history,
    exactly_once_problems,
    loss_curve,
)
from nbtools._demo.samples import DecodedSamples, make_volume
from nbtools._demo.training import DemoConfig, steps_per_epoch, train

__all__ = [
    "DecodedSamples",
    "DemoConfig",
    "DemoOutcome",
    "continuity_problems",
    "effective_history",
    "exactly_once_problems",
    "loss_curve",
    "make_volume",
    "report",
    "run_demo",
    "run_pair",
    "steps_per_epoch",
    "train",
]
