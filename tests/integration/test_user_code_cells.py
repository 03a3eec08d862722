"""Names defined in notebook cells behave in a rank as in the kernel, both ways.

A real kernel defines a function, a dataset and a model class in cells, so they
live in the kernel's ``__main__`` and reach the ranks by value. Inside the
ranks, code that pickles them by reference (``multiprocessing.Pool.map``,
``spawn`` and ``forkserver`` loader workers, ``torch.save``) must find them,
and a model of the cell's class must come back from every rank.
"""

from __future__ import annotations

import re
import textwrap

import pytest
from _user_code_nb import NotebookKernel

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    with NotebookKernel(tmp_path_factory.mktemp("kernel")) as nb:
        nb.run(
            textwrap.dedent("""\
            import multiprocessing
            import torch
            from torch.utils.data import DataLoader, Dataset
            from nbtools import distributed
        """)
        )
        nb.run(
            textwrap.dedent("""\
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
        """)
        )
        yield nb


def test_a_cell_defined_model_comes_back_from_every_rank_equal_to_rank_0s(kernel):
    kernel.run(
        textwrap.dedent("""\
        @distributed(processes=2, output="none")
        def train():
            import torch.distributed as dist

            torch.manual_seed(0)
            net = Net()
            for p in net.parameters():
                dist.broadcast(p.data, 0)
            return net

        models = train.distributed()
    """)
    )
    assert kernel.eval("[type(m).__name__ for m in models]") == ["Net", "Net"]
    assert kernel.eval("isinstance(models[1], Net)") is True
    assert (
        kernel.eval(
            "all(torch.equal(a, b) for a, b in zip(models[0].state_dict().values(), "
            "models[1].state_dict().values()))"
        )
        is True
    )


def test_cell_functions_and_classes_resolve_by_reference_inside_ranks(kernel, tmp_path):
    kernel.run(
        textwrap.dedent(f"""\
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
    """)
    )
    found = kernel.eval("[{k: v for k, v in f.items() if k != 'saved'} for f in found]")
    for rank in found:
        assert rank["fork"] == [0, 1, 8, 27] and rank["spawn"] == [0, 1, 8]
        assert rank["spawn loader"] == rank["forkserver loader"] == [0, 1, 4, 9, 16, 25]
    # What a rank saved loads in the kernel as the cell's own class.
    assert kernel.eval(
        "[isinstance(torch.load(f['saved'], weights_only=False), Net) for f in found]"
    ) == [True, True]


def test_a_warning_from_cell_code_names_the_cell_and_shows_the_source_line(kernel):
    kernel.run(
        textwrap.dedent("""\
        import warnings


        def check(x):
            if x > 1:
                warnings.warn("x is large")   # line 6 of this cell
            return x
    """)
    )
    cell = len(kernel.nb.cells)
    text = kernel.run(
        textwrap.dedent("""\
        @distributed(processes=2)
        def warns():
            return check(5)

        warns.distributed()
    """)
    )
    label = f"Cell In[{kernel.nb.cells[cell - 1].execution_count}], line 6: UserWarning: x is large"
    assert f"[rank 0] {label}" in text, text
    assert '[rank 0]   warnings.warn("x is large")' in text, text
    assert "<dynamic-code>" not in text


def test_the_kernels_logging_configuration_applies_in_ranks_and_the_functions_own_wins(kernel):
    kernel.run(
        textwrap.dedent("""\
        import logging
        logging.basicConfig(level=logging.INFO, format="%(levelname)s|%(name)s|%(message)s")
    """)
    )
    text = kernel.run(
        textwrap.dedent("""\
        @distributed(processes=2)
        def logs():
            import torch.distributed as dist

            logging.getLogger("train").info("step %d", dist.get_rank())
            logging.getLogger("train").debug("not shown at INFO")

        logs.distributed()
    """)
    )
    assert "[rank 0] INFO|train|step 0" in text and "[rank 1] INFO|train|step 1" in text, text
    assert "not shown" not in text

    text = kernel.run(
        textwrap.dedent("""\
        @distributed(processes=2)
        def configures():
            logging.basicConfig(level=logging.WARNING, format="OWN %(message)s")
            logging.getLogger("train").info("hidden")
            logging.getLogger("train").warning("shown")

        configures.distributed()
    """)
    )
    assert "[rank 0] OWN shown" in text and "hidden" not in text, text


def test_rich_output_of_rank_0_reaches_the_cell_as_rich_output(kernel):
    kernel.run(
        textwrap.dedent("""\
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
    """)
    )
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


def _rich(cell) -> list:
    return [o for o in cell.outputs if o.output_type == "display_data"]


def test_rich_output_all_shows_every_ranks_display_labelled_by_rank(kernel):
    source = textwrap.dedent("""\
        @distributed(processes=2{option})
        def shows():
            import torch.distributed as dist
            from IPython.display import HTML, display

            display(HTML(f"<b>from rank {{dist.get_rank()}}</b>"))

        shows.distributed()
    """)
    kernel.run(source.format(option=""))
    html = [o.data.get("text/html") for o in _rich(kernel.nb.cells[-1])]
    assert html == ["<b>from rank 0</b>"], html  # the default: rank 0's only

    text = kernel.run(source.format(option=', rich_output="all"'))
    html = sorted(o.data.get("text/html") for o in _rich(kernel.nb.cells[-1]))
    assert html == ["<b>from rank 0</b>", "<b>from rank 1</b>"], html
    assert "[rank 0]" in text and "[rank 1]" in text  # whose it is, rank 0's included


def test_a_figure_left_as_the_last_expression_of_a_pool_cell_shows_as_png(kernel):
    kernel.run("%load_ext nbtools\n%distributed start --processes 2")
    try:
        kernel.run(
            textwrap.dedent("""\
            %%distributed
            import matplotlib.pyplot as plt
            fig = plt.figure()
            plt.plot([1, 2, 3])
            fig
        """)
        )
        rich = _rich(kernel.nb.cells[-1])
        png = [o for o in rich if "image/png" in o.data]
        assert len(png) == 1 and len(png[0].data["image/png"]) > 1000, rich
        assert png[0].data["text/plain"].startswith("[rank 0] <Figure")
        # rank 1's value stays text (rich_output="rank0"), as it did before
        assert any(o.data["text/plain"].startswith("[rank 1] <Figure") for o in rich), rich
        # the figure was shown and closed, as the inline backend closes a cell's figures
        kernel.run("%%distributed\nopen_figures = len(plt.get_fignums())")
        assert kernel.eval("%distributed pull open_figures") == [0, 0]
    finally:
        kernel.run("%distributed stop")


def test_logging_configured_after_a_pool_started_reaches_its_ranks_on_the_next_call(kernel):
    kernel.run("%load_ext nbtools\n%distributed start --processes 2")
    try:
        kernel.run(
            textwrap.dedent("""\
            import logging
            logging.basicConfig(level=logging.INFO, format="LATE|%(name)s|%(message)s", force=True)
        """)
        )
        text = kernel.run(
            textwrap.dedent("""\
            %%distributed
            import logging
            logging.getLogger("train").info("after the start")
        """)
        )
        assert "[rank 0] LATE|train|after the start" in text, text
        assert "[rank 1] LATE|train|after the start" in text, text
        kernel.run(
            'logging.getLogger().handlers[0].setFormatter(logging.Formatter("AGAIN %(message)s"))'
        )
        text = kernel.run('%%distributed\nlogging.getLogger("train").info("changed")')
        assert "[rank 0] AGAIN changed" in text and "LATE|" not in text, text
    finally:
        kernel.run("%distributed stop")


def test_autoresume_names_its_body_after_its_own_cell(kernel, tmp_path):
    import nbformat
    from nbclient.exceptions import CellExecutionError

    kernel.run("%load_ext nbtools")
    kernel.run(
        "model = torch.nn.Linear(2, 1)\noptimizer = torch.optim.SGD(model.parameters(), lr=0.1)"
    )
    cell = nbformat.v4.new_code_cell(
        f"%%autoresume {tmp_path / 'ckpt'} --every 5 --state model,optimizer\n"
        "for step in range(start_step, 2):\n"
        "    checkpoint(step)\n"
        "raise ValueError('diverged')\n"
    )
    kernel.nb.cells.append(cell)
    with pytest.raises(CellExecutionError):
        kernel.client.execute_cell(cell, len(kernel.nb.cells) - 1)
    number = cell.execution_count  # from the kernel's execute reply
    lines = [line for o in cell.outputs if o.output_type == "error" for line in o.traceback]
    traceback = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(lines))
    assert f"Cell In[{number}], line 4" in traceback, traceback
