"""Names of other products, so code written for them runs on nbtools unchanged.

- :mod:`nbtools.compat.serverless_gpu`: the managed serverless-GPU runtime's
  ``serverless_gpu`` package (``distributed``, ``data.UCVolumeDataset``,
  ``data.DataLoader``, ``data.UCVolumeWriter``, ``data.UCVolumeReader``,
  ``runtime``), with nbtools' classes underneath.

This package sits above every other part of nbtools: it imports launch,
checkpoint and data; nothing in nbtools imports it, and ``import nbtools``
does not load it.
"""

from __future__ import annotations

__all__ = ["serverless_gpu"]
