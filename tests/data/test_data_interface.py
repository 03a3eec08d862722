"""The loader drives a dataset only through the declared interface (``DatasetLink``)."""

from __future__ import annotations

import ast
import inspect

from nbtools.data import _dataset_link as _driven
from nbtools.data import loader


def _private_uses(module) -> set[str]:
    """``obj._name`` in ``module`` where ``obj`` is not ``self`` or a module of nbtools."""
    tree = ast.parse(inspect.getsource(module))
    modules = {"_tags", "_torch_compat", "events", "runtime", "torch"}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            if node.attr.startswith("__"):
                continue
            base = node.value
            if isinstance(base, ast.Name) and base.id in {"self", *modules}:
                continue
            found.add(f"{ast.unparse(base)}.{node.attr}")
    return found


def test_the_loader_uses_no_private_member_of_the_dataset():
    assert _private_uses(loader) == set()


def test_the_declared_interface_is_small():
    public = [n for n in vars(_driven.DatasetLink) if not n.startswith("_")]
    assert sorted(public) == sorted(
        [
            "dataset",
            "stream_id",
            "plan",
            "give_workers",
            "received",
            "received_batch",
            "position",
            "restore",
            "finished",
            "cache",
            "stream_share",
        ]
    )
