"""The trainer integrations' tests drive real kernels with the helpers of tests/integration."""

from __future__ import annotations

import sys
from pathlib import Path

_HELPERS = str(Path(__file__).resolve().parents[1] / "integration")
if _HELPERS not in sys.path:
    sys.path.append(_HELPERS)
