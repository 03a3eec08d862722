"""Names defined in notebook cells behave in a rank as in the kernel, both ways.

A real kernel defines a function, a dataset and a model class in cells, so they
live in the kernel's ``__main__`` and reach the ranks by value. Inside the
ranks, code that pickles them by reference (``multiprocessing.Pool.map``,
``spawn`` and ``forkserver`` loader workers, ``torch.save``) must find them,
and a model of the cell's class must come back from every rank.
"""

from __future__ import annotations

import textwrap

import pytest
from _user_code_nb import NotebookKernel

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    with NotebookKernel(tmp_path_factory.mktemp("kernel")) as nb:
        nb.run(textwrap.dedent("""\
            import multiprocessing
            import torch
            from torch.utils.data import DataLoader, Dataset
            from nbtools import distributed
        """))
        nb.run(textwrap.dedent("""\
            def cube(x):
                return x ** 3


            class Squares(Dataset):
                def __len__(self):
                    return 6

                def __getitem__(self, i):
                    return i * i


            class Net(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    self.body = torch.nn.Linear(128, 256)   # 128 KiB: travels out of band

                def forward(self, x):
                    return self.body(x)
        """))
        yield nb


def test_a_cell_defined_model_comes_back_from_every_rank_equal_to_rank_0s(kernel):
    kernel.run(textwrap.dedent("""\
        @distributed(processes=2, output="none")
        def train():
            import torch.distributed as dist

            torch.manual_seed(0)
            net = Net()
            for p in net.parameters():
                dist.broadcast(p.data, 0)
            return net

        models = train.distributed()
    """))
    assert kernel.eval("[type(m).__name__ for m in models]") == ["Net", "Net"]
    assert kernel.eval("isinstance(models[1], Net)") is True
    assert kernel.eval(
        "all(torch.equal(a, b) for a, b in zip(models[0].state_dict().values(), "
        "models[1].state_dict().values()))"
    ) is True


def test_cell_functions_and_classes_resolve_by_reference_inside_ranks(kernel, tmp_path):
    kernel.run(textwrap.dedent(f"""\
        @distributed(processes=2, output="none")
        def by_reference(folder):
            import os
            import torch.distributed as dist

            rank = dist.get_rank()
            out = {{}}
            with multiprocessing.Pool(2) as pool:           # the rank's default: fork
                out["fork"] = pool.map(cube, range(4))
            with multiprocessing.get_context("spawn").Pool(1) as pool:
                out["spawn"] = pool.map(cube, range(3))
            for method in ("spawn", "forkserver"):
                loader = DataLoader(Squares(), batch_size=3, num_workers=1,
                                    multiprocessing_context=method)
                out[method + " loader"] = [int(v) for batch in loader for v in batch]
            path = os.path.join(folder, f"net-{{rank}}.pt")
            torch.save(Net(), path)                          # pickles Net by reference
            out["saved"] = path
            return out

        found = by_reference.distributed({str(tmp_path)!r})
    """))
    found = kernel.eval("[{k: v for k, v in f.items() if k != 'saved'} for f in found]")
    for rank in found:
        assert rank["fork"] == [0, 1, 8, 27] and rank["spawn"] == [0, 1, 8]
        assert rank["spawn loader"] == rank["forkserver loader"] == [0, 1, 4, 9, 16, 25]
    # What a rank saved loads in the kernel as the cell's own class.
    assert kernel.eval(
        "[isinstance(torch.load(f['saved'], weights_only=False), Net) for f in found]"
    ) == [True, True]


def test_a_warning_from_cell_code_names_the_cell_and_shows_the_source_line(kernel):
    kernel.run(textwrap.dedent("""\
        import warnings


        def check(x):
            if x > 1:
                warnings.warn("x is large")   # line 6 of this cell
            return x
    """))
    cell = len(kernel.nb.cells)
    text = kernel.run(textwrap.dedent("""\
        @distributed(processes=2)
        def warns():
            return check(5)

        warns.distributed()
    """))
    label = f"Cell In[{kernel.nb.cells[cell - 1].execution_count}], line 6: UserWarning: x is large"
    assert f"[rank 0] {label}" in text, text
    assert '[rank 0]   warnings.warn("x is large")' in text, text
    assert "<dynamic-code>" not in text


def test_the_kernels_logging_configuration_applies_in_ranks_and_the_functions_own_wins(kernel):
    kernel.run(textwrap.dedent("""\
        import logging
        logging.basicConfig(level=logging.INFO, format="%(levelname)s|%(name)s|%(message)s")
    """))
    text = kernel.run(textwrap.dedent("""\
        @distributed(processes=2)
        def logs():
            import torch.distributed as dist

            logging.getLogger("train").info("step %d", dist.get_rank())
            logging.getLogger("train").debug("not shown at INFO")

        logs.distributed()
    """))
    assert "[rank 0] INFO|train|step 0" in text and "[rank 1] INFO|train|step 1" in text, text
    assert "not shown" not in text

    text = kernel.run(textwrap.dedent("""\
        @distributed(processes=2)
        def configures():
            logging.basicConfig(level=logging.WARNING, format="OWN %(message)s")
            logging.getLogger("train").info("hidden")
            logging.getLogger("train").warning("shown")

        configures.distributed()
    """))
    assert "[rank 0] OWN shown" in text and "hidden" not in text, text


def test_rich_output_of_rank_0_reaches_the_cell_as_rich_output(kernel):
    kernel.run(textwrap.dedent("""\
        @distributed(processes=2)
        def report():
            import torch.distributed as dist
            import matplotlib.pyplot as plt
            import pandas as pd
            from IPython.display import HTML, Markdown, display

            print("before")
            display(pd.DataFrame({"loss": [0.5, 0.25]}))
            display(Markdown("**done**"), HTML("<i>rank</i>"))
            plt.plot([1, 2, 3])
            plt.show()
            print("after")
            return dist.get_rank()

        report.distributed()
    """))
    outputs = kernel.nb.cells[-1].outputs
    rich = [o for o in outputs if o.output_type == "display_data"]
    kinds = [sorted(o.data) for o in rich]
    assert len(rich) == 4, kinds  # rank 0's only: the table, the Markdown, the HTML, the figure
    assert "text/html" in rich[0].data and "<table" in rich[0].data["text/html"]
    assert rich[1].data["text/markdown"] == "**done**"
    assert rich[2].data["text/html"] == "<i>rank</i>"
    assert "image/png" in rich[3].data and len(rich[3].data["image/png"]) > 1000
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "[rank 0] before" in text and "[rank 0] after" in text
    assert "Figure(" not in text and "loss" not in text  # no text stand-ins
    order = [o.output_type for o in outputs]
    assert order.index("display_data") > 0  # "before" came first


def test_rich_output_of_a_distributed_cell_reaches_that_cell(kernel):
    kernel.run("%load_ext nbtools\n%distributed start --processes 2")
    try:
        kernel.run("%%distributed\nimport pandas as pd\nfrom IPython.display import display")
        kernel.run("%%distributed\ndisplay(pd.DataFrame({'acc': [0.9]}))\nprint('shown')")
        outputs = kernel.nb.cells[-1].outputs
        rich = [o for o in outputs if o.output_type == "display_data"]
        assert len(rich) == 1 and "<table" in rich[0].data["text/html"], outputs
    finally:
        kernel.run("%distributed stop")
