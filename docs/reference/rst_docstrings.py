"""A Griffe extension for the API page: ticklock's docstrings are written in reST, the page in
Markdown. Turns ``:role:`name``` into code spans and ``text::`` plus an indented block into a
fenced code block, so that neither shows its markup on the page, and takes an attribute's
trailing ``#: comment`` (as Sphinx does) as its docstring. A function that takes
``**options: Unpack[JobOptions]`` (``Scheduler.job``, ``Scheduler.add``) is shown with those
keywords as its parameters, so that its ``:param ...:`` fields render as one table.
"""

from __future__ import annotations

import ast
import re
import textwrap
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|meth|func|attr|data|mod|exc|obj):`~?([^`]+)`")
TRAILING = re.compile(r"#:\s*(.+?)\s*$")
UNPACK = re.compile(r"^Unpack\[(\w+)\]$")

#: The defaults of the keywords of ``Scheduler.job()``, which a ``TypedDict`` cannot carry:
#: shown in the reference's table; ``tests/test_docs.py`` checks them against ``Job.declare``.
JOB_OPTION_DEFAULTS = {
    "id": "None",
    "timeout": "None",
    "enabled": "True",
    "catch_up": "True",
    "overdue_grace": "None",
    "retries": "0",
    "retry_backoff": "10.0",
    "max_batches": "None",
    "failure_threshold": "1",
    "start": "None",
    "end": "None",
    "limit": "None",
    "immediately": "False",
    "overlap": "None",
}


def _fence(block: list[str]) -> list[str]:
    code = textwrap.dedent("\n".join(block)).strip("\n")
    try:
        ast.parse(code)
        language = "python"
    except SyntaxError:
        language = "text"
    return [f"```{language}", *code.splitlines(), "```"]


def markdown(text: str) -> str:
    """``text`` (a reST docstring) with its roles and literal blocks in Markdown."""
    text = ROLE.sub(lambda m: f"`{m.group(1)}`", text)
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line.rstrip().endswith("::"):
            out.append(line)
            continue
        head = line.rstrip()[:-2].rstrip()
        if head:
            out.append(head + ":")
        indent = len(line) - len(line.lstrip())
        while i < len(lines) and not lines[i].strip():
            i += 1
        block: list[str] = []
        while i < len(lines) and (
            not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent
        ):
            block.append(lines[i])
            i += 1
        out += ["", *_fence(block), ""]
    return "\n".join(out)


def _unpack_options(func: griffe.Function) -> None:
    """Replace ``**options: Unpack[JobOptions]`` by JobOptions' keywords, in their order."""
    params = list(func.parameters)
    if not params or params[-1].kind is not griffe.ParameterKind.var_keyword:
        return
    match = UNPACK.match(str(params[-1].annotation))
    if match is None:
        return
    options = func.module.modules_collection["ticklock._schedule.job"].members[match.group(1)]
    keywords = [
        griffe.Parameter(
            name,
            annotation=member.annotation,
            kind=griffe.ParameterKind.keyword_only,
            default=JOB_OPTION_DEFAULTS[name],
        )
        for name, member in options.members.items()
        if member.is_attribute
    ]
    func.parameters = griffe.Parameters(*params[:-1], *keywords)


class RstDocstrings(griffe.Extension):
    """Rewrites every docstring once the package is loaded."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if isinstance(obj, griffe.Function):
            _unpack_options(obj)
        if obj.docstring is None and obj.is_attribute and obj.lineno is not None:
            lines = obj.lines  # the attribute's source lines: its trailing comment ends the first
            comment = TRAILING.search(lines[0]) if lines else None
            if comment:
                obj.docstring = griffe.Docstring(comment.group(1), parent=obj)
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
