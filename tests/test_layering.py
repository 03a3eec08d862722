"""The dependency direction of DESIGN.md: worker-side imports pull in no front end."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import nbtools

FRONT_ENDS = ("IPython", "ipywidgets", "plotly", "mlflow")


def _imported_after(code: str) -> list[str]:
    probe = (
        code
        + "\nimport json, sys\n"
        + f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {FRONT_ENDS!r})))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_core_packages_import_no_front_end():
    code = "\n".join(
        [
            "import nbtools",
            "import nbtools.runtime, nbtools.errors",
            "import nbtools.launch",
            "import nbtools.checkpoint",
            "import nbtools.data",
            "import nbtools.monitor",
            "import nbtools.events",
            "from nbtools import distributed, DistributedError, events",
            "from nbtools.checkpoint import CheckpointManager, VolumeWriter, VolumeReader, find_latest_valid",
            "from nbtools.data import VolumeDataset, DataLoader",
        ]
    )
    assert _imported_after(code) == []


def test_import_nbtools_is_lazy():
    probe = "import nbtools, sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_events_is_base_layer():
    # Every core package emits events, so importing them must pull in no core package,
    # no torch, no third-party library at all.
    probe = (
        "import json, sys\n"
        "before = set(sys.modules)\n"
        "from nbtools import events\n"
        "events.emit('probe', value=1.0)\n"
        "new = sorted(m.split('.')[0] for m in set(sys.modules) - before)\n"
        "nb = sorted(m for m in set(sys.modules) - before if m.startswith('nbtools.'))\n"
        "print(json.dumps(sorted(set(m for m in new if m != 'nbtools' and m not in sys.stdlib_module_names))))\n"
        "print(json.dumps(nb))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    third_party, ours = (json.loads(line) for line in out.stdout.strip().splitlines())
    assert third_party == []
    assert all(
        m.startswith(("nbtools.events", "nbtools._internal", "nbtools.errors")) for m in ours
    ), ours


def test_events_sources_import_only_the_base_layer():
    import ast
    from pathlib import Path

    allowed = ("nbtools.events", "nbtools._internal", "nbtools.errors")
    root = Path(__file__).resolve().parents[1] / "nbtools" / "events"
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert (
                    top in sys.stdlib_module_names
                    or name.startswith(allowed)
                    or top == "__future__"
                ), f"{path.name} imports {name}: nbtools.events is base layer (stdlib only)"


@pytest.mark.parametrize("front", ["nbtools.monitor.pane", "nbtools.magics", "nbtools.tracking"])
def test_front_end_modules_do_load_their_libraries(front):
    # The check above is meaningful only if the front ends really are where those imports live.
    assert _imported_after(f"import {front}") != []


def test_ruff_bans_front_end_imports_in_core(tmp_path):
    ruff = pytest.importorskip("ruff")
    del ruff
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    bad = root / "nbtools" / "data" / "_layering_probe.py"
    bad.write_text("import plotly  # noqa: F401\n")
    try:
        out = subprocess.run(
            [sys.executable, "-m", "ruff", "check", "--no-cache", "--select", "TID251", str(bad)],
            capture_output=True,
            text=True,
            cwd=root,
            timeout=60,
        )
    finally:
        bad.unlink()
    assert out.returncode != 0
    assert "TID251" in out.stdout


def _nbtools_imports() -> dict[str, set[str]]:
    """``{module: nbtools modules it imports}``, lazy (function-level) imports included."""
    import ast

    root = Path(nbtools.__file__).parent
    paths = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        paths[name] = path
    edges: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges[name] |= {a.name for a in node.names if a.name in paths}
            elif isinstance(node, ast.ImportFrom):
                target = node.module or ""
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    if sub in paths:
                        edges[name].add(sub)
                    elif target in paths and target != name:
                        edges[name].add(target)
    return edges


def test_no_import_circle_inside_nbtools():
    edges = _nbtools_imports()
    circles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for other in sorted(edges[module]):
            if state.get(other) == 1:
                circles.append(path[path.index(other) :] + [other])
            elif other not in state:
                visit(other, path + [other])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_the_import_circle_check_sees_a_lazy_circle(tmp_path, monkeypatch):
    # The check must see what a maintainer sees: an import inside a function counts too.
    fake = tmp_path / "nbtools"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "a.py").write_text("def f():\n    from nbtools import b\n")
    (fake / "b.py").write_text("from nbtools.a import f\n")
    monkeypatch.setattr(nbtools, "__file__", str(fake / "__init__.py"))
    with pytest.raises(AssertionError, match="nbtools.a -> nbtools.b -> nbtools.a"):
        test_no_import_circle_inside_nbtools()


def test_no_upward_lookup_through_sys_modules():
    # A lower layer that finds a higher one in sys.modules depends on it as surely as
    # an import does: the base layer may look up only itself, core packages only the base.
    lower = {"_internal", "events", "errors", "runtime"}
    root = Path(nbtools.__file__).parent
    found = []
    for path in root.rglob("*.py"):
        package = path.relative_to(root).parts[0].removesuffix(".py")
        text = path.read_text()
        for looked_up in re.findall(r"sys\.modules(?:\.get\(|\[)\s*['\"](nbtools\.[\w.]+)", text):
            target = looked_up.split(".")[1]
            if target == package:
                continue
            if package in lower or target not in lower:
                found.append(f"{path.relative_to(root)} looks up {looked_up}")
    assert not found, found


def test_the_pool_sits_above_the_backend_seam():
    # The pool has a package of its own, and nothing below it (the plain call's runner,
    # the backends, the rank set-up) imports it: only launch's front door does.
    edges = _nbtools_imports()
    assert "nbtools.launch.pool._pool" in edges
    front_door = {"nbtools.launch", "nbtools.launch._api"}
    found = [
        f"{module} imports {other}"
        for module, others in edges.items()
        if module.startswith("nbtools.launch.")
        and not module.startswith("nbtools.launch.pool")
        and module not in front_door
        for other in others
        if other.startswith("nbtools.launch.pool")
    ]
    assert not found, found


#: The units of ``nbtools.data``, lowest first: each imports only units before it.
#: The three rooms are where copies live (``_cache``), where the list of files comes
#: from (``_listing``) and how a stream serves them (``_stream``); the rest sit around them.
_DATA_UNITS = (
    "_positions",
    "_stalls",
    "_cache",
    "_listing",
    "_stream",
    "_plan",
    "dataset",
    "_dataset_link",
    "loader",
)


def _data_unit(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["nbtools", "data"] or len(parts) == 2:
        return None  # the package's front door imports what it exports
    return parts[2]


def test_data_rooms_import_downward_only():
    edges = _nbtools_imports()
    units = {_data_unit(m) for m in edges} - {None}
    assert units == set(_DATA_UNITS), "a unit of nbtools.data missing from the order above"
    rank = {unit: i for i, unit in enumerate(_DATA_UNITS)}
    found = [
        f"{module} imports {other}"
        for module, others in edges.items()
        if _data_unit(module) is not None
        for other in others
        if _data_unit(other) is not None
        and _data_unit(other) != _data_unit(module)
        and rank[_data_unit(other)] > rank[_data_unit(module)]
    ]
    assert not found, found


def test_the_checkpoint_storage_half_never_imports_the_manager_half():
    # How bytes move (checkpoint/_storage/) sits below writer.py and reader.py; the
    # manager half (state, host buffers, lease, retention, tiers) sits above both.
    edges = _nbtools_imports()
    assert "nbtools.checkpoint._storage._target" in edges
    found = [
        f"{module} imports {other}"
        for module, others in edges.items()
        if module.startswith("nbtools.checkpoint._storage")
        for other in others
        if other.startswith("nbtools.checkpoint")
        and not other.startswith("nbtools.checkpoint._storage")
    ]
    assert not found, found


def test_data_keeps_at_most_twelve_units():
    root = Path(nbtools.__file__).parent / "data"
    direct = [p.name for p in root.iterdir() if p.name != "__pycache__" and p.name != "__init__.py"]
    assert len(direct) <= 12, sorted(direct)


def test_no_module_over_800_lines():
    # Modules are cut by concern; a concern may take up to about 700 lines, and nothing
    # grows past 800 (the boundary lists in *_compat modules included).
    root = Path(nbtools.__file__).parent
    long = [
        f"{p.relative_to(root)}: {n} lines"
        for p in sorted(root.rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > 800
    ]
    assert not long, long


#: Sub-rooms whose front door (their ``__init__``) is the only way in from outside them.
_FRONT_DOORS = ("nbtools.checkpoint._memory", "nbtools.checkpoint._storage")


def _front_door_breaches(room: str) -> list[str]:
    """Where code outside ``room`` reaches past its ``__init__``: an import of one of its
    modules (lazy ones included), a name its ``__all__`` does not export, or a dotted
    string (a hook such as ``"pkg.mod:func"``, or a module name) naming one of its modules
    or such a name; prose that mentions a module is not a way in."""
    import ast

    root = Path(nbtools.__file__).parent
    door = root.parent.joinpath(*room.split("."), "__init__.py")
    exported: set[str] = set()
    for node in ast.parse(door.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            exported = set(ast.literal_eval(node.value))
    found = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if name == room or name.startswith(room + "."):
            continue
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        where = path.relative_to(root.parent)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found += [
                    f"{where}:{node.lineno} imports {a.name}"
                    for a in node.names
                    if a.name.startswith(room + ".")
                ]
            elif isinstance(node, ast.ImportFrom):
                target = node.module or ""
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                if target.startswith(room + "."):
                    found.append(f"{where}:{node.lineno} imports from {target}")
                elif target == room:
                    found += [
                        f"{where}:{node.lineno} imports {a.name}, which {room} does not export"
                        for a in node.names
                        if a.name not in exported
                    ]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                ref = node.value  # a whole string that names a module or a name in it
                if re.fullmatch(re.escape(room) + r"[.:][\w.]+", ref) and (
                    ref.startswith(room + ".") or ref.split(":", 1)[1] not in exported
                ):
                    found.append(f"{where}:{node.lineno} names {ref}")
    return found


@pytest.mark.parametrize("room", _FRONT_DOORS)
def test_outside_code_enters_a_checkpoint_sub_room_only_through_its_front_door(room):
    assert room in _nbtools_imports(), f"{room} is gone: update _FRONT_DOORS"
    found = _front_door_breaches(room)
    assert not found, found


def test_the_front_door_check_sees_a_lazy_import_past_the_door(tmp_path, monkeypatch):
    # The check must see what a maintainer sees: a module, an unexported name, a hook string.
    fake = tmp_path / "nbtools"
    (fake / "room").mkdir(parents=True)
    (fake / "__init__.py").write_text('HOOK = "nbtools.room:hidden"\n')
    (fake / "room" / "__init__.py").write_text('__all__ = ["shown"]\nshown = 1\n')
    (fake / "room" / "_inner.py").write_text("hidden = 2\n")
    (fake / "user.py").write_text(
        "from nbtools.room import shown\n"
        "def f():\n"
        "    from nbtools.room._inner import hidden\n"
        "    from .room import hidden as h\n"
    )
    monkeypatch.setattr(nbtools, "__file__", str(fake / "__init__.py"))
    found = _front_door_breaches("nbtools.room")
    assert found == [
        "nbtools/__init__.py:1 names nbtools.room:hidden",
        "nbtools/user.py:3 imports from nbtools.room._inner",
        "nbtools/user.py:4 imports hidden, which nbtools.room does not export",
    ]
