"""Sphinx extension of the nbtools site: generated reference tables and checks of the built pages.

Directives (in a MyST page, as ```` ```{nbtools-settings} ````):

- ``nbtools-settings``: the table of ``NBTOOLS_*`` variables, from
  :data:`nbtools._internal.settings.SETTINGS` (option ``:internal:`` for the ones nbtools sets
  in its ranks).
- ``nbtools-cli``: every subcommand of the ``nbtools`` command line and its flags, read from its
  argparse parser.
- ``nbtools-magic``: one magic's usage and options, read from its parser (``%gpu_pane``,
  ``%%autoresume``, ``%distributed``); the directive's content gives ``--flag: meaning`` lines
  for options whose parser has no help, and an option left without a meaning is a warning.

Notebook pages show the PNG saved beside a plotly figure (``docs/_tools/run_notebooks.py`` saves
one); the figure's JSON, which a static page cannot draw, is left out of the page.

Checks, each a warning (an error under ``sphinx -W``), on every page as it is written:

- text of an unresolved role (``{doc}`` followed by its target) outside code;
- a notebook saved without running it (a code cell with no execution count), or one whose
  saved outputs do not all appear on its page (an output whose types none renders).
"""

from __future__ import annotations

import argparse
import json
import os
import re
from html.parser import HTMLParser
from typing import Any

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

__all__ = [
    "setup",
    "unresolved_roles",
    "rendered_outputs",
    "notebook_problems",
    "drop_rendered_plotly",
    "settings_table",
    "cli_reference",
    "magic_parsers",
    "magic_reference",
    "options_table",
    "parse_meanings",
    "unexplained",
]

_log = logging.getLogger(__name__)

#: A role left as text: ``{doc}`` or ``{py:func}`` right before its backquoted target.
_ROLE = re.compile(r"\{[a-z][a-z0-9]*(?::[a-z][a-z0-9-]*)*\}(?=`)")
_SKIP = {"pre", "code", "script", "style", "kbd", "samp", "tt"}


class _Text(HTMLParser):
    """The page's text outside code, with a backquote where an inline code element starts."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._depth = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _SKIP:
            if tag == "code" and self._depth == 0:
                self.parts.append("`")
            self._depth += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in _SKIP and self._depth:
            self._depth -= 1

    def handle_data(self, data: str) -> None:
        if not self._depth:
            self.parts.append(data)


def unresolved_roles(html: str) -> list[str]:
    """Each role written as text in ``html`` (outside code), with a little of what follows."""
    parser = _Text()
    parser.feed(html)
    parser.close()
    text = "".join(parser.parts)
    return [text[m.start() : m.end() + 40].split("\n")[0] for m in _ROLE.finditer(text)]


_OUTPUT = re.compile(r'<div class="cell_output[ "]')


def rendered_outputs(html: str) -> int:
    """How many outputs the page shows: the children of its ``cell_output`` containers."""

    class _Outputs(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0
            self._stack: list[bool] = []  # per open div: is it a cell_output container

        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            classes = (dict(attrs).get("class") or "").split()
            inside = bool(self._stack) and self._stack[-1]
            if inside and (tag == "img" or (tag == "div" and "output" in classes)):
                self.count += 1
            if tag == "div":
                # Only the container's direct children count; nothing below them does.
                self._stack.append("cell_output" in classes)

        def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            self.handle_starttag(tag, attrs)
            if tag == "div":
                self._stack.pop()

        def handle_endtag(self, tag: str) -> None:
            if tag == "div" and self._stack:
                self._stack.pop()

    parser = _Outputs()
    parser.feed(html)
    parser.close()
    return parser.count


def _saved_outputs(cell: dict[str, Any]) -> int:
    """The outputs of a cell that a page shows: widget views and empty streams show nothing."""
    count = 0
    for output in cell.get("outputs", []):
        if output.get("output_type") == "stream" and not "".join(output.get("text", "")):
            continue
        data = output.get("data", {})
        if set(data) == {"application/vnd.jupyter.widget-view+json"}:
            continue
        if output.get("output_type") in ("display_data", "execute_result") and not data:
            continue
        count += 1
    return count


def notebook_problems(notebook: dict[str, Any], html: str) -> list[str]:
    """What is wrong with a notebook's page: cells never run, outputs the page does not show."""
    code = [cell for cell in notebook.get("cells", []) if cell.get("cell_type") == "code"]
    problems = []
    unrun = [i for i, cell in enumerate(code, 1) if cell.get("execution_count") is None]
    if unrun:
        problems.append(
            f"saved without its outputs (code cells {', '.join(map(str, unrun))} never ran): "
            "run it with python docs/_tools/run_notebooks.py and commit it"
        )
    saved = sum(_saved_outputs(cell) for cell in code)
    shown = rendered_outputs(html)
    if shown < saved:
        problems.append(
            f"the page shows {shown} of the {saved} outputs saved in the notebook: an output "
            "has no type the site renders (add a PNG rendering beside it)"
        )
    return problems


#: Plotly's figure JSON: a page has no renderer for it, but shows the PNG saved beside it.
PLOTLY = "application/vnd.plotly.v1+json"


def drop_rendered_plotly(notebook: dict[str, Any]) -> bool:
    """Remove each plotly figure's JSON that has a PNG beside it; return whether any was.

    A figure saved without a PNG keeps its JSON, so that myst-nb reports it
    (``mystnb.unknown_mime_type``) and the page check finds the output missing.
    """
    changed = False
    for cell in notebook.get("cells", []):
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if PLOTLY in data and "image/png" in data:
                del data[PLOTLY]
                changed = True
    return changed


def _drop_rendered_plotly(app: Sphinx, docname: str, source: list[str]) -> None:
    """``source-read``: a notebook page shows the PNG saved beside a plotly figure."""
    if not str(app.env.doc2path(docname)).endswith(".ipynb"):
        return
    notebook = json.loads(source[0])
    if drop_rendered_plotly(notebook):
        source[0] = json.dumps(notebook)


def _check_page(
    app: Sphinx, pagename: str, templatename: str, context: dict[str, Any], doctree: Any
) -> None:
    body = context.get("body") or ""
    if not body:
        return
    for found in unresolved_roles(body):
        _log.warning(
            "unresolved role shown as text: %r",
            found,
            location=pagename,
            type="nbtools",
            subtype="role",
        )
    source = str(app.env.doc2path(pagename)) if pagename in app.env.all_docs else ""
    if source.endswith(".ipynb"):
        with open(source, encoding="utf-8") as fh:
            notebook = json.load(fh)
        for problem in notebook_problems(notebook, body):
            _log.warning("%s", problem, location=pagename, type="nbtools", subtype="notebook")


# --- generated reference ---------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def settings_table(internal: bool = False) -> list[str]:
    """Markdown lines of the settings table (user-facing, or those nbtools sets for ranks)."""
    from nbtools._internal.settings import SETTINGS

    lines = ["| Variable | Type | Default | What it changes |", "| --- | --- | --- | --- |"]
    for setting in SETTINGS:
        if setting.internal == internal:
            lines.append(
                f"| `{setting.name}` | {_cell(setting.type)} | {_cell(setting.default)} "
                f"| {_cell(setting.meaning)} |"
            )
    return lines


def _flag(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest.upper()}`"
    name = ", ".join(action.option_strings)
    if action.nargs == 0:
        return f"`{name}`"
    if action.choices:
        return f"`{name} {'|'.join(map(str, action.choices))}`"
    number = action.type in (int, float) or getattr(action.type, "__name__", "") == "integer"
    return f"`{name} {action.metavar or ('N' if number else action.dest.upper())}`"


def _default(action: argparse.Action) -> str:
    if action.nargs == 0 or action.default in (None, argparse.SUPPRESS):
        return ""
    return f"`{action.default}`"


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        action
        for action in parser._actions
        if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction))
    ]


def _name(action: argparse.Action) -> str:
    if action.option_strings:
        return action.option_strings[-1]
    return action.metavar if isinstance(action.metavar, str) else action.dest


def options_table(
    parser: argparse.ArgumentParser, meanings: dict[str, str] | None = None
) -> list[str]:
    """Markdown lines of a table of a parser's arguments: flag, default, meaning.

    The meaning is the argument's ``help``, else ``meanings[name]`` (``--gpus``, ``NAME``);
    without either for any argument, the table has no meaning column.
    """
    actions = _options(parser)
    if not actions:
        return []
    meanings = meanings or {}
    told = {_name(a): a.help or meanings.get(_name(a), "") for a in actions}
    explained = any(told.values())
    lines = [
        "| Option | Default |" + (" Meaning |" if explained else ""),
        "| --- | --- |" + (" --- |" if explained else ""),
    ]
    for action in actions:
        row = f"| {_cell(_flag(action))} | {_cell(_default(action))} |"
        lines.append(row + (f" {_cell(told[_name(action)])} |" if explained else ""))
    return lines


def unexplained(parser: argparse.ArgumentParser, meanings: dict[str, str]) -> list[str]:
    """The arguments of ``parser`` with neither ``help`` nor an entry in ``meanings``."""
    return [_name(a) for a in _options(parser) if not a.help and not meanings.get(_name(a))]


def parse_meanings(lines: list[str]) -> dict[str, str]:
    """``--flag: what it does`` lines (continued on indented lines) as ``{"--flag": ...}``."""
    meanings: dict[str, str] = {}
    name = ""
    for line in lines:
        if line[:1].isspace() and name:
            meanings[name] += " " + line.strip()
        elif ":" in line:
            name, text = line.split(":", 1)
            name = name.strip()
            meanings[name] = text.strip()
    return meanings


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _helps(parser: argparse.ArgumentParser) -> dict[str, str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {choice.dest: choice.help or "" for choice in action._choices_actions}
    return {}


def cli_parser() -> argparse.ArgumentParser:
    """The ``nbtools`` command line's parser, caught as ``main()`` builds it."""
    from nbtools import __main__ as cli

    caught: list[argparse.ArgumentParser] = []

    class _Caught(Exception):
        pass

    original = argparse.ArgumentParser.parse_args

    def _catch(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        caught.append(self)
        raise _Caught

    argparse.ArgumentParser.parse_args = _catch  # type: ignore[method-assign]
    try:
        cli.main([])
    except _Caught:
        pass
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
    return caught[0]


def cli_reference() -> list[str]:
    """Markdown lines: each subcommand of ``nbtools``, what it does, its flags."""
    parser = cli_parser()
    lines: list[str] = []
    helps = _helps(parser)
    top = options_table(parser)
    if top:
        lines += ["`nbtools`", "", *top, ""]
    for name, sub in _subparsers(parser).items():
        lines += [f"`nbtools {name}`: {helps.get(name, '')}", ""]
        table = options_table(sub)
        lines += [*(table or ["No options."]), ""]
    return lines


def magic_parsers(name: str) -> dict[str, argparse.ArgumentParser]:
    """The parsers of magic ``name``: one per command for ``distributed``, else ``{"": parser}``."""
    if name == "distributed":
        from nbtools._magics.distributed import _parser

        return _subparsers(_parser())
    from IPython.core.magic_arguments import construct_parser  # noqa: TID251 (docs build)

    from nbtools.magics import NbtoolsMagics

    return {"": construct_parser(getattr(NbtoolsMagics, name))}


def magic_reference(name: str, meanings: dict[str, str] | None = None) -> list[str]:
    """Markdown lines: the usage and options of magic ``name`` (``gpu_pane``, ...).

    ``%distributed``'s commands share their options: its table is that of ``start``.
    """
    parsers = magic_parsers(name)
    usages = [_usage(sub) for sub in parsers.values()]
    if name != "distributed" and name in _cell_magics():  # IPython's parser names it %name
        usages = ["%" + usage for usage in usages]
    lines = ["```text", *usages, "```", ""]
    if name == "distributed":
        lines += ["Options of `start` and `restart`:", ""]
        return [*lines, *options_table(parsers["start"], meanings), ""]
    return [*lines, *options_table(parsers[""], meanings), ""]


def _usage(parser: argparse.ArgumentParser) -> str:
    """A parser's usage on one line, without argparse's "usage: ", IPython's "::" and wrapping."""
    words = parser.format_usage().replace("usage: ", "", 1).split()
    return " ".join(words[1:] if words[:1] == ["::"] else words)


def _cell_magics() -> set[str]:
    """The names of the extension's cell magics (``autoresume``)."""
    from nbtools.magics import NbtoolsMagics

    magics: dict[str, dict[str, str]] = getattr(NbtoolsMagics, "magics", None) or {}
    return set(magics.get("cell", {}))


class _Generated(SphinxDirective):
    """Renders Markdown lines made at build time into the page."""

    has_content = False

    def lines(self) -> list[str]:
        raise NotImplementedError

    def run(self) -> list[nodes.Node]:
        container = nodes.container()
        source = self.get_source_info()[0]
        self.state.nested_parse(StringList(self.lines(), source=source), 0, container)
        return container.children


class SettingsDirective(_Generated):
    option_spec = {"internal": lambda _: True}

    def lines(self) -> list[str]:
        self.env.note_dependency(os.path.join(_PACKAGE, "_internal", "settings.py"))
        return settings_table(internal="internal" in self.options)


class CliDirective(_Generated):
    def lines(self) -> list[str]:
        self.env.note_dependency(os.path.join(_PACKAGE, "__main__.py"))
        return cli_reference()


class MagicDirective(_Generated):
    """A magic's usage and options; the content gives ``--flag: meaning`` lines for options
    whose parser has no help. An option with no meaning, or a meaning for no option, is a
    warning."""

    required_arguments = 1
    has_content = True

    def lines(self) -> list[str]:
        self.env.note_dependency(os.path.join(_PACKAGE, "magics.py"))
        self.env.note_dependency(os.path.join(_PACKAGE, "_magics", "distributed.py"))
        name = self.arguments[0].lstrip("%")
        meanings = parse_meanings(list(self.content))
        parsers = magic_parsers(name)
        known = {_name(a) for sub in parsers.values() for a in _options(sub)}
        for flag in sorted(set(meanings) - known):
            _log.warning(
                "%%%s has no option %s", name, flag, location=self.get_location(), type="nbtools"
            )
        shown = parsers["start"] if name == "distributed" else parsers[""]
        for flag in unexplained(shown, meanings):
            _log.warning(
                "%%%s %s has no help: say what it does in the directive's content",
                name,
                flag,
                location=self.get_location(),
                type="nbtools",
            )
        return magic_reference(name, meanings)


_PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "nbtools")


def setup(app: Sphinx) -> dict[str, Any]:
    """Register the directives and the page checks."""
    app.add_directive("nbtools-settings", SettingsDirective)
    app.add_directive("nbtools-cli", CliDirective)
    app.add_directive("nbtools-magic", MagicDirective)
    app.connect("source-read", _drop_rendered_plotly)
    app.connect("html-page-context", _check_page)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
