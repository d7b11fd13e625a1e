"""Which statements of an SQL text would end, replace or change the tick's transaction.

SQL is read as PostgreSQL's lexer reads it, just far enough to find where each statement
starts and its leading keywords: whitespace and comments (``--`` to the end of the line,
``/* */`` nested) are skipped; string literals (``'...'`` with ``''``, ``E'...'`` with
backslash escapes, ``B'`` ``X'`` ``N'`` ``U&'``), quoted identifiers (``"..."``, ``U&"..."``)
and dollar quotes (``$tag$...$tag$``) are opaque; a ``;`` anywhere else ends a statement.
Nothing more is parsed.

The split errs towards more statements, never fewer: a ``;`` inside parentheses or inside a
``CREATE FUNCTION ... BEGIN ATOMIC ... END`` body also ends one here. The server refuses the
first as a syntax error; the second makes its ``END`` look like a statement of its own, and
is refused (write such a body as ``AS $$ ... $$``). So a statement the server would run is
never hidden inside one read here.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

# PostgreSQL's identifier characters: ASCII letters, digits, _ and $ (not first), and every
# non-ASCII character (the server reads any byte from 0x80 as a letter).
_NON_ASCII = "\u0080-\U0010ffff"
_TOKEN = re.compile(
    rf"""
      (?P<space>[ \t\n\r\f\v]+)
    | (?P<line>--[^\n\r]*)
    | (?P<block>/\*)
    | (?P<escape>[eE]')
    | (?P<standard>(?:[bBxX]|[uU]&)')
    | (?P<plain>[nN]?')
    | (?P<quoted>(?:[uU]&)?")
    | (?P<dollar>\$(?:[A-Za-z_{_NON_ASCII}][A-Za-z0-9_{_NON_ASCII}]*)?\$)
    | (?P<word>[A-Za-z_{_NON_ASCII}][A-Za-z0-9_${_NON_ASCII}]*)
    | (?P<semicolon>;)
    | (?P<other>[^ \t\n\r\f\v\-/'"$;A-Za-z_{_NON_ASCII}]+|.)
    """,
    re.VERBOSE | re.DOTALL,
)
_COMMENT_EDGE = re.compile(r"/\*|\*/")
_QUOTE = re.compile("'")
_QUOTE_OR_BACKSLASH = re.compile(r"['\\]")
_DOUBLE_QUOTE = re.compile('"')
_WORDS = 3  # leading keywords kept: enough for ROLLBACK WORK TO, SET LOCAL TRANSACTION


@dataclass(frozen=True, slots=True)
class Statement:
    """One statement of an SQL text: its leading keywords and its text."""

    words: tuple[str, ...]
    """The statement's first words, upper-cased, as long as nothing else comes before them
    (``("ROLLBACK", "TO", "A")``); a word with non-ASCII characters is never a keyword and
    is kept as written."""
    text: str
    """The statement from its first token to its end, without the ``;``."""


def split(sql: str, *, standard_strings: bool = True) -> Iterator[Statement]:
    """The statements of ``sql``, in order, as the server would split it (see the module
    docstring); empty statements (``;;``, a text of comments) are left out.

    ``standard_strings``: the session's ``standard_conforming_strings``. When it is off, a
    backslash escapes in a plain ``'...'`` string too, which moves where the string ends.
    """
    words: list[str] = []
    leading = True  # no token other than a word seen yet in this statement
    start = -1  # where the statement's first token starts
    pos, end = 0, len(sql)
    while pos < end:
        token = _TOKEN.match(sql, pos)
        assert token is not None  # the last alternative matches any character
        kind, after = token.lastgroup, token.end()
        if kind in ("space", "line"):
            pos = after
            continue
        if kind == "block":
            pos = _comment_end(sql, after)
            continue
        if kind == "semicolon":
            if start >= 0:
                yield Statement(tuple(words), sql[start:pos].rstrip())
            words, leading, start, pos = [], True, -1, after
            continue
        if start < 0:
            start = pos
        if kind == "word" and leading:
            if len(words) < _WORDS:
                text = token.group()
                words.append(text.upper() if text.isascii() else text)
        else:
            leading = False
        backslashes = kind == "escape" or (kind == "plain" and not standard_strings)
        if backslashes:
            pos = _closing(sql, after, _QUOTE_OR_BACKSLASH, "'")
        elif kind in ("standard", "plain"):
            pos = _closing(sql, after, _QUOTE, "'")
        elif kind == "quoted":
            pos = _closing(sql, after, _DOUBLE_QUOTE, '"')
        elif kind == "dollar":
            close = sql.find(token.group(), after)
            pos = end if close < 0 else close + len(token.group())
        else:
            pos = after
    if start >= 0:
        yield Statement(tuple(words), sql[start:].rstrip())


def _comment_end(sql: str, pos: int) -> int:
    """The index just past the ``*/`` that closes a block comment opened before ``pos``
    (comments nest); the end of ``sql`` if none does."""
    depth = 1
    for edge in _COMMENT_EDGE.finditer(sql, pos):
        depth += 1 if edge.group() == "/*" else -1
        if depth == 0:
            return edge.end()
    return len(sql)


def _closing(sql: str, pos: int, stops: re.Pattern[str], quote: str) -> int:
    """The index just past the quote that closes a literal whose body starts at ``pos``: a
    doubled quote stands for one, and a backslash (when ``stops`` finds it) escapes the next
    character; the end of ``sql`` if nothing closes it."""
    while (stop := stops.search(sql, pos)) is not None:
        at = stop.start()
        if sql[at] == "\\" or sql.startswith(quote, at + 1):  # an escape, or a doubled quote
            pos = at + 2
        else:
            return at + 1
    return len(sql)


_ENDS = frozenset({"ABORT", "BEGIN", "COMMIT", "END", "START"})
"""Keywords whose statement always ends the transaction or opens one (COMMIT PREPARED too)."""


def controls_transaction(words: tuple[str, ...]) -> bool:
    """Whether a statement that starts with ``words`` would end, replace or change the
    transaction it runs in.

    ``ROLLBACK TO [SAVEPOINT]`` undoes to a savepoint and keeps the transaction;
    ``SAVEPOINT`` and ``RELEASE`` keep it too. ``SET [LOCAL|SESSION] TRANSACTION`` and
    ``SET [LOCAL|SESSION] transaction_read_only`` change it: the one change the server
    accepts once a transaction has run a query, read-only, would make ticklock's own commit
    fail (the commit says so when it came by another route, ``set_config()`` say).
    """
    match words:
        case (first, *_) if first in _ENDS:
            return True
        case ("ROLLBACK", "WORK" | "TRANSACTION", *rest) | ("ROLLBACK", *rest):
            return rest[:1] != ["TO"]
        case ("PREPARE", "TRANSACTION", *_):
            return True
        case ("SET", "TRANSACTION" | "TRANSACTION_READ_ONLY", *_):
            return True
        case ("SET", "LOCAL" | "SESSION", "TRANSACTION" | "TRANSACTION_READ_ONLY", *_):
            return True
    return False


def transaction_control(sql: str, *, standard_strings: bool = True) -> Statement | None:
    """The first statement of ``sql`` that would end, replace or change the transaction it
    runs in (see :func:`controls_transaction`), or ``None``."""
    for statement in split(sql, standard_strings=standard_strings):
        if controls_transaction(statement.words):
            return statement
    return None
