"""The SQL statement classifier: where statements start, and which would end or change the
tick's transaction. Pure: the same texts against a real server are in test_session_edges.py."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ticklock._backends.postgres.statements import controls_transaction, split, transaction_control

REFUSED = [
    ("commit", "COMMIT", "COMMIT"),
    ("commit_lower", "commit", "commit"),
    ("commit_work", "COMMIT WORK", "COMMIT WORK"),
    ("commit_and_chain", "COMMIT AND CHAIN", "COMMIT AND CHAIN"),
    ("commit_prepared", "COMMIT PREPARED 'x'", "COMMIT PREPARED 'x'"),
    ("end", "END", "END"),
    ("end_transaction", "end transaction", "end transaction"),
    ("abort", "ABORT", "ABORT"),
    ("rollback", "ROLLBACK", "ROLLBACK"),
    ("rollback_work", "ROLLBACK WORK", "ROLLBACK WORK"),
    ("rollback_and_chain", "ROLLBACK AND CHAIN", "ROLLBACK AND CHAIN"),
    ("rollback_prepared", "ROLLBACK PREPARED 'x'", "ROLLBACK PREPARED 'x'"),
    ("begin", "BEGIN", "BEGIN"),
    ("begin_isolation", "BEGIN ISOLATION LEVEL SERIALIZABLE", "BEGIN ISOLATION LEVEL SERIALIZABLE"),
    ("start_transaction", "START TRANSACTION", "START TRANSACTION"),
    ("prepare_transaction", "PREPARE TRANSACTION 'gid'", "PREPARE TRANSACTION 'gid'"),
    ("set_transaction", "SET TRANSACTION READ ONLY", "SET TRANSACTION READ ONLY"),
    ("set_local_transaction", "set local transaction read only", "set local transaction read only"),
    (
        "set_session_transaction",
        "SET SESSION TRANSACTION READ ONLY",
        "SET SESSION TRANSACTION READ ONLY",
    ),
    (
        "set_local_transaction_read_only",
        "SET LOCAL transaction_read_only = on",
        "SET LOCAL transaction_read_only = on",
    ),
    (
        "set_transaction_read_only",
        "set transaction_read_only to on",
        "set transaction_read_only to on",
    ),
    ("second_statement", "VALUES (1); COMMIT", "COMMIT"),
    ("commit_then_begin", "COMMIT; BEGIN", "COMMIT"),
    ("last_without_semicolon", "SELECT 1;SELECT 2;commit", "commit"),
    ("after_empty_statements", ";;  ; COMMIT;;", "COMMIT"),
    ("after_line_comment", "-- say why\nCOMMIT", "COMMIT"),
    ("line_comment_ends_at_cr", "SELECT 1 -- x\r; COMMIT", "COMMIT"),
    ("after_block_comment", "/* why */COMMIT", "COMMIT"),
    ("after_nested_comment", "/* a /* b */ c */ COMMIT", "COMMIT"),
    ("comment_between_words", "ROLLBACK /* not TO */ ; SELECT 1", "ROLLBACK /* not TO */"),
    ("after_string", "SELECT 'a;b'; COMMIT", "COMMIT"),
    ("after_doubled_quote", "SELECT 'it''s'; COMMIT", "COMMIT"),
    # with standard_conforming_strings on, a backslash is an ordinary character in '...'
    ("backslash_in_plain_string", "SELECT 'a\\'; COMMIT; --'", "COMMIT"),
    ("after_escape_string", "SELECT E'a\\'b'; COMMIT", "COMMIT"),
    ("after_escaped_backslash", "SELECT E'a\\\\'; COMMIT; --'", "COMMIT"),
    ("after_dollar_quote", "SELECT $$;$$; COMMIT", "COMMIT"),
    ("after_tagged_dollar_quote", "SELECT $f$ $$ ; $f$; COMMIT", "COMMIT"),
    # $ continues an identifier: x$$ is one name, not the start of a dollar quote
    ("dollar_inside_identifier", "SELECT 1 AS x$$; COMMIT; SELECT 2 AS y$$", "COMMIT"),
    ("after_quoted_identifier", 'SELECT 1 AS "a;""b"; COMMIT', "COMMIT"),
    ("after_bit_string", "SELECT B'0'; COMMIT", "COMMIT"),
    ("after_unicode_string", "SELECT U&'\\0041;'; COMMIT", "COMMIT"),
    ("tab_and_newlines", "\t\n COMMIT\n", "COMMIT"),
    ("vertical_tab_and_form_feed", "SELECT 1;\v\fCOMMIT", "COMMIT"),
    # a BEGIN ATOMIC body is split at its semicolons: its END reads as a statement
    (
        "begin_atomic_body",
        "CREATE FUNCTION f() RETURNS int LANGUAGE sql BEGIN ATOMIC SELECT 1; END",
        "END",
    ),
    ("semicolon_in_parentheses", "SELECT (1; COMMIT; 2)", "COMMIT"),
]


@pytest.mark.parametrize(("sql", "refused"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_a_statement_that_ends_or_changes_the_transaction_is_found(sql: str, refused: str) -> None:
    statement = transaction_control(sql)
    assert statement is not None
    assert statement.text == refused


ALLOWED = [
    ("select", "SELECT 1"),
    ("empty", ""),
    ("only_comments", "-- COMMIT\n/* COMMIT */"),
    ("savepoint", "SAVEPOINT a"),
    ("rollback_to", "ROLLBACK TO a"),
    ("rollback_to_savepoint", "ROLLBACK TO SAVEPOINT a"),
    ("rollback_work_to", "rollback work to savepoint a"),
    ("rollback_transaction_to", "ROLLBACK TRANSACTION TO a"),
    ("rollback_to_comment", "ROLLBACK/* x */TO a"),
    ("release", "RELEASE a; RELEASE SAVEPOINT b"),
    (
        "savepoint_round",
        "SAVEPOINT a; INSERT INTO t VALUES (1); ROLLBACK TO SAVEPOINT a; RELEASE a",
    ),
    ("set_local", "SET LOCAL statement_timeout = 1000"),
    ("set_session_characteristics", "SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY"),
    ("prepare_statement", "PREPARE p AS SELECT 1"),
    ("keyword_not_first", "SELECT commit FROM t"),
    ("keyword_as_column", "INSERT INTO t (begin, end_) VALUES (1, 2)"),
    ("keyword_after_number", "SELECT 1; 1 COMMIT"),
    ("keyword_after_parenthesis", "(COMMIT)"),
    ("quoted_keyword", '"COMMIT"'),
    ("keyword_in_string", "SELECT 'x; COMMIT; y'"),
    ("keyword_in_doubled_quotes", "SELECT 'it''s; COMMIT'"),
    ("keyword_in_escape_string", "SELECT E'\\'; COMMIT; \\''"),
    ("keyword_in_escape_string_lower", "SELECT e'\\\\\\'; COMMIT'"),
    ("keyword_in_national_string", "SELECT N'; COMMIT'"),
    ("keyword_in_bit_strings", "SELECT B'0''; COMMIT; --'"),
    ("keyword_in_unicode_string", "SELECT U&'; COMMIT'"),
    ("keyword_in_dollar_quote", "SELECT $$; COMMIT; $$"),
    ("keyword_in_tagged_dollar_quote", "SELECT $body$ $$; COMMIT; $$ $body$"),
    ("dollar_tags_are_case_sensitive", "SELECT $a$ ; COMMIT; $A$ $a$"),
    ("keyword_in_do_block", "DO $$ BEGIN COMMIT; END $$"),
    ("keyword_in_procedure", "CREATE PROCEDURE p() LANGUAGE plpgsql AS $$ BEGIN COMMIT; END $$"),
    ("keyword_in_quoted_identifier", 'SELECT 1 AS "; COMMIT; "'),
    ("keyword_in_unicode_identifier", 'SELECT 1 AS U&"; COMMIT"'),
    ("keyword_in_line_comment", "SELECT 1 -- ; COMMIT"),
    ("keyword_in_block_comment", "SELECT 1 /* ; COMMIT */"),
    ("keyword_in_nested_comment", "SELECT /* /* */ ; COMMIT; */ 1"),
    ("dash_dash_in_block_comment", "SELECT /* -- */ 1"),
    ("block_in_line_comment", "SELECT 1 -- /*\n; SELECT 2"),
    ("unterminated_string", "SELECT '; COMMIT"),
    ("unterminated_dollar_quote", "SELECT $$; COMMIT"),
    ("unterminated_comment", "SELECT /* ; COMMIT"),
    # non-ASCII letters belong to an identifier, as on the server: none is a keyword
    ("no_break_space_in_word", "COMMIT\xa0AND CHAIN"),
    ("non_ascii_prefix", "\xa0COMMIT"),
    ("kelvin_sign", "ROLLBAC\u212a"),
    ("dotless_i", "COMM\u0131T"),
    ("fullwidth", "\uff23\uff2f\uff2d\uff2d\uff29\uff34"),
    ("identifier_with_dollar", "COMMIT$1"),
    ("longer_identifier", "COMMITTED; BEGINNING; ENDS; ABORTED; STARTS"),
]


@pytest.mark.parametrize("sql", [a[1] for a in ALLOWED], ids=[a[0] for a in ALLOWED])
def test_a_statement_that_keeps_the_transaction_is_allowed(sql: str) -> None:
    assert transaction_control(sql) is None


def test_with_standard_conforming_strings_off_a_backslash_escapes_in_plain_strings() -> None:
    hidden = "SELECT 'a\\'; COMMIT; --'"  # one string when a backslash escapes
    shown = "SELECT 'a\\''; COMMIT; SELECT 'b'"  # \' is a quote, '' closes the string
    assert transaction_control(hidden, standard_strings=False) is None
    statement = transaction_control(shown, standard_strings=False)
    assert statement is not None and statement.text == "COMMIT"
    assert transaction_control(shown) is None  # with the setting on, one string to the end
    # E'...' escapes either way, U&'...' and B'...' never
    assert transaction_control("SELECT U&'\\'; COMMIT", standard_strings=False) is not None


def test_split_gives_each_statement_its_leading_words_and_text() -> None:
    sql = "/* lead */ rollback work to savepoint a ; SELECT 'x' ;; Rollback/**/Transaction"
    assert [(s.words, s.text) for s in split(sql)] == [
        (("ROLLBACK", "WORK", "TO"), "rollback work to savepoint a"),
        (("SELECT",), "SELECT 'x'"),
        (("ROLLBACK", "TRANSACTION"), "Rollback/**/Transaction"),
    ]
    assert [s.words for s in split("\xe9t\xe9; select")] == [("\xe9t\xe9",), ("SELECT",)]


@pytest.mark.parametrize(
    ("words", "controls"),
    [
        (("ROLLBACK", "TO"), False),
        (("ROLLBACK", "WORK", "TO"), False),
        (("ROLLBACK", "TRANSACTION", "TO"), False),
        (("ROLLBACK", "WORK"), True),
        (("ROLLBACK", "AND"), True),
        (("PREPARE", "TRANSACTION"), True),
        (("PREPARE", "P", "AS"), False),
        (("SET", "LOCAL", "TRANSACTION"), True),
        (("SET", "LOCAL", "X"), False),
        ((), False),
    ],
    ids=lambda value: "_".join(value).lower() if isinstance(value, tuple) else str(value),
)
def test_controls_transaction(words: tuple[str, ...], controls: bool) -> None:
    assert controls_transaction(words) is controls


# -- property: keywords hidden in opaque tokens never count; at a statement's start they do --

TEXT = st.text(alphabet=st.sampled_from("ab ;'\"$\\-/*\n\xa0COMMIT"), max_size=20)


TOKENS = ("plain", "escape", "dollar", "quoted", "line", "block")


@st.composite
def opaque(draw: st.DrawFn, kinds: tuple[str, ...] = TOKENS) -> str:
    """A token whose content the lexer must not read: a literal, a quoted name, a comment."""
    body = draw(TEXT)
    kind = draw(st.sampled_from(kinds))
    if kind == "plain":
        return "'" + body.replace("'", "''") + "'"
    if kind == "escape":
        return "E'" + body.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if kind == "dollar":
        tag = draw(st.sampled_from(["", "q", "body_1"]))
        return f"${tag}$" + body.replace(f"${tag}$", "") + f"${tag}$"
    if kind == "quoted":
        return '"' + body.replace('"', '""') + '"'
    if kind == "line":
        return "--" + body.replace("\n", " ").replace("\r", " ") + "\n"
    inner = body.replace("/*", "").replace("*/", "")
    return (
        f"/*{inner}*/" if not inner.endswith("/") and not inner.endswith("*") else f"/*{inner} */"
    )


PLAIN = st.sampled_from(["SELECT", "1", "x", "t.y", "(", ")", ",", "+", "AS", "FROM"])
CONTROL = st.sampled_from(["COMMIT", "END", "ABORT", "BEGIN", "ROLLBACK", "START TRANSACTION"])


@st.composite
def statement(draw: st.DrawFn) -> tuple[str, bool]:
    """A statement and whether it ends the transaction: a plain or a control keyword first,
    then tokens, some of them opaque texts full of semicolons and keywords."""
    control = draw(st.booleans())
    first = draw(CONTROL) if control else draw(st.sampled_from(["SELECT", "INSERT", "SAVEPOINT"]))
    rest = draw(st.lists(st.one_of(PLAIN, opaque()), max_size=6))
    return " ".join([first, *rest]), control


@settings(max_examples=400, deadline=None)
@given(
    statements=st.lists(statement(), min_size=1, max_size=5),
    lead=st.lists(opaque(("line", "block")), max_size=2),
)
def test_only_a_control_keyword_that_starts_a_statement_counts(
    statements: list[tuple[str, bool]], lead: list[str]
) -> None:
    sql = " ".join(lead) + " " + "; ".join(text for text, _ in statements)
    found = [controls_transaction(s.words) for s in split(sql)]
    assert found == [control for _, control in statements], sql
