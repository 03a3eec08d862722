"""``gpus=1`` on a local Ray node with a GPU: nccl in the group, ``cuda:LOCAL_RANK`` as device."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_one_gpu_rank_on_a_local_ray_node(tmp_path):
    script = tmp_path / "gpu_driver.py"
    script.write_text(
        textwrap.dedent(
            """
        import json, os
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        import ray
        ray.init(num_cpus=1, num_gpus=1, include_dashboard=False, log_to_driver=False)
        from nbtools import distributed

        @distributed(gpus=1, cluster="ray")
        def on_gpu():
            import torch, torch.distributed as dist
            t = torch.ones(4, device="cuda")
            dist.all_reduce(t)
            return {
                "backend": str(dist.get_backend()),
                "device": str(t.device),
                "current": torch.cuda.current_device(),
                "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "sum": t.sum().item(),
            }

        try:
            print("RESULT", json.dumps(on_gpu.distributed()))
        finally:
            ray.shutdown()
        """
        )
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=400)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, out.stdout[-3000:] + out.stderr[-3000:]
    import json

    [result] = json.loads(lines[0][len("RESULT ") :])
    assert "nccl" in result["backend"]
    assert result["device"] == "cuda:0" and result["current"] == 0
    assert result["visible"] and result["sum"] == 4.0
