"""Replacing a checkpoint on an S3-compatible server, SIGKILLed at several points.

The same driver as ``test_resave.py``, against moto's server on loopback (the
fixture of ``test_s3.py``): the new ``.metadata`` is published with one PUT,
there is no directory rename, and the directory still always loads as the old
or the new checkpoint.
"""

from __future__ import annotations

import pytest
from test_resave import _assert_old_or_new, _run_driver
from test_s3 import BUCKET, s3  # noqa: F401 - the loopback S3 server fixture


@pytest.mark.slow
@pytest.mark.usefixtures("s3")
def test_sigkill_while_replacing_a_checkpoint_on_s3_leaves_old_or_new(tmp_path):
    url = f"s3://{BUCKET}/run/ckpt"
    report = _run_driver(tmp_path, url, 8)
    _assert_old_or_new(report, url)
