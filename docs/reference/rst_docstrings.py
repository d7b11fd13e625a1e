"""A Griffe extension for the API page: ticklock's docstrings are written in reST, the page in
Markdown. Turns ``:role:`name``` into code spans and ``text::`` plus an indented block into a
fenced code block, so that neither shows its markup on the page, and takes an attribute's
trailing ``#: comment`` (as Sphinx does) as its docstring.
"""

from __future__ import annotations

import ast
import re
import textwrap
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|meth|func|attr|data|mod|exc|obj):`~?([^`]+)`")
TRAILING = re.compile(r"#:\s*(.+?)\s*$")


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


class RstDocstrings(griffe.Extension):
    """Rewrites every docstring once the package is loaded."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is None and obj.is_attribute and obj.lineno is not None:
            lines = obj.lines  # the attribute's source lines: its trailing comment ends the first
            comment = TRAILING.search(lines[0]) if lines else None
            if comment:
                obj.docstring = griffe.Docstring(comment.group(1), parent=obj)
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
