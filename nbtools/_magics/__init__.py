"""Implementation of the IPython magics registered by ``nbtools.magics``.

``%%autoresume`` runs a cell again from its newest checkpoint after a failure
(:mod:`.autoresume`); ``%distributed`` / ``%%distributed`` keep a pool of ranks
for the cells that follow (:mod:`.distributed`). Both read the running cell
through :mod:`._cells`.
"""

from __future__ import annotations

from nbtools._magics._cells import cell_number, strip_comment
from nbtools._magics.autoresume import AutoresumeOptions, run_autoresume
from nbtools._magics.distributed import DistributedMagics

__all__ = [
    "AutoresumeOptions",
    "DistributedMagics",
    "cell_number",
    "run_autoresume",
    "strip_comment",
]
