"""The managed runtime's ``serverless_gpu`` names, on nbtools.

Code copied from that runtime's documentation runs after one change of import::

    from nbtools.compat.serverless_gpu import distributed     # was: from serverless_gpu import distributed
    from nbtools.compat.serverless_gpu.data import UCVolumeWriter, UCVolumeReader
    from nbtools.compat import serverless_gpu                 # serverless_gpu.data.UCVolumeDataset(...)

Nothing here has logic of its own: each name is nbtools' class or decorator.
An argument that only means something on the managed service (``remote=True``,
``gpu_type=``, ``run_async=True``) is taken, and one warning line says what
nbtools does instead.
"""

from __future__ import annotations

from nbtools.compat.serverless_gpu import data, runtime
from nbtools.compat.serverless_gpu._launch import distributed

__all__ = ["distributed", "data", "runtime"]
