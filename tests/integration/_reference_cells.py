"""The samples of the managed runtime's documentation, as notebook cells on nbtools.

Names are swapped to ``nbtools.compat.serverless_gpu``; the volume paths point
at a local directory (``VOLUME``, set by the first cell). Shared by the kernel
test and by notebook 09.
"""

from __future__ import annotations

__all__ = ["CELLS"]

SETUP = """\
import os, random, tempfile
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.utils.data import IterableDataset
from nbtools.compat import serverless_gpu
import nbtools.compat.serverless_gpu.data
from nbtools.compat.serverless_gpu import distributed

VOLUME = os.environ.get("VOLUME") or tempfile.mkdtemp(prefix="volume-")
os.makedirs(f"{VOLUME}/data", exist_ok=True)
for i in range(20):  # small "image" files: 4 floats each; an epoch is 5 steps on 2 ranks
    np.full(4, i / 20, dtype=np.float32).tofile(f"{VOLUME}/data/{i:03d}.bin")
"""

DATASET = '''\
class DecodedDataset(IterableDataset):
    """Decodes each cached file path from UCVolumeDataset into a tensor."""

    def __init__(self, path_dataset):
        self._path_dataset = path_dataset

    def __iter__(self):
        for local_path in self._path_dataset:
            yield torch.from_numpy(np.fromfile(local_path, dtype=np.float32))
'''

TRAIN = """\
CHECKPOINT_EVERY = 4

@distributed(gpus=2)
def train(total_steps):
    dist.init_process_group(backend="cpu:gloo,cuda:nccl")  # as documented; the group exists
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    path_dataset = serverless_gpu.data.UCVolumeDataset(f"{VOLUME}/data")
    loader = serverless_gpu.data.DataLoader(DecodedDataset(path_dataset), batch_size=2)

    checkpoint_future = None

    def save_async(step, model, optimizer):
        nonlocal checkpoint_future
        if checkpoint_future is not None:
            checkpoint_future.result()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state_dict = {"model": model_sd, "optim": optim_sd, "step": step}
        writer = serverless_gpu.data.UCVolumeWriter(f"{VOLUME}/checkpoints/step_{step}")
        checkpoint_future = dcp.async_save(state_dict, storage_writer=writer)

    def find_latest_valid(checkpoint_root):
        if not os.path.isdir(checkpoint_root):
            return None
        candidates = sorted(
            (d for d in os.listdir(checkpoint_root) if d.startswith("step_")),
            key=lambda d: int(d.split("_")[1]),
            reverse=True,
        )
        for name in candidates:
            path = os.path.join(checkpoint_root, name)
            if os.path.exists(os.path.join(path, ".metadata")):
                return path
        return None

    latest = find_latest_valid(f"{VOLUME}/checkpoints")
    start_step = 0
    if latest is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd, "step": 0}
        dcp.load(state, storage_reader=serverless_gpu.data.UCVolumeReader(latest))
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        start_step = state["step"]

    steps, saved, epochs = [], [], 0

    def batches_forever():  # epoch after epoch: a new iterator over the loader each time
        nonlocal epochs
        while True:
            epochs += 1
            yield from loader

    batches = batches_forever()
    for step in range(start_step, total_steps):
        batch = next(batches)
        loss = model(batch).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        steps.append(step)
        if step % CHECKPOINT_EVERY == 0:
            save_async(step, model, optimizer)
            saved.append(step)
    if checkpoint_future is not None:
        checkpoint_future.result()
    return {"start": start_step, "steps": steps, "saved": saved, "epochs": epochs,
            "weight": model.weight.detach().flatten().tolist()}
"""

RNG = """\
def seed_everything(seed: int):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)

seed_everything(0)
state_dict = {"rng": {"python": random.getstate(), "numpy": np.random.get_state(),
                      "torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all()}}
expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
rng = state_dict["rng"]
random.setstate(rng["python"])
np.random.set_state(rng["numpy"])
torch.set_rng_state(rng["torch"])
torch.cuda.set_rng_state_all(rng["cuda"])
(random.random(), float(np.random.rand()), float(torch.rand(1))) == expected
"""

CELLS = {"setup": SETUP, "dataset": DATASET, "train": TRAIN, "rng": RNG}
