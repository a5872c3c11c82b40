"""Line layout of generated source: every line within :data:`WIDTH` characters.

:func:`layout` rewrites only whitespace, comments and the wrapping of docstring text:

* a trailing comment that makes a line too long moves to its own line(s) above the
  statement it annotates;
* a comment line too long is wrapped (same indentation, ``# `` on every line);
* a code line too long is broken inside brackets (Python's implicit line continuation) after
  a comma or before a binary operator, a conditional's ``if`` / ``else`` or a comprehension's
  ``for`` -- at the loosest-binding one that fits, never inside a loop's target -- the
  continuation indented 8 columns deeper than the statement; an assignment's or a return's value
  broken at its top level is parenthesised;
* a docstring line too long is wrapped at spaces, at the docstring's indentation.

The result is checked: its AST equals the input's (docstrings compared with their
whitespace normalised), so layout can never change what the code does.  A line that
cannot be shortened this way (one long word) is left as it is.
"""
from __future__ import annotations

import ast
import io
import re
import textwrap
import tokenize

WIDTH = 100
CONTINUATION = 8


class LayoutError(AssertionError):
    """The layout changed the code's AST (a bug in this module)."""


def layout(text: str, width: int = WIDTH) -> str:
    """``text`` (Python source) with every line within ``width`` where possible."""
    lines = text.split("\n")
    if all(len(ln) <= width for ln in lines):
        return text
    out = _layout(_rejoin(text, width), width)
    if _normalised_ast(out) != _normalised_ast(text):
        raise LayoutError("the line layout changed the generated code's AST")
    return out


OPERAND_END = (tokenize.NAME, tokenize.NUMBER, tokenize.STRING)
# the operators a line breaks before, by how loosely they bind: at the same bracket depth a line
# breaks at the loosest (after a comma first, then before a comprehension's ``for``, ...), so that a
# break never splits an operand of a looser operator (``[None]`` / ``* n`` after ``else``)
BREAK_BEFORE = {"for": 0.1, "if": 0.2, "else": 0.2, "or": 0.3, "and": 0.4, "+": 0.5, "-": 0.5,
                "*": 0.6, "@": 0.6, "/": 0.6}


def _layout(text: str, width: int) -> str:
    lines = text.split("\n")
    comment_of, breaks, rhs_of, text_lines, logical_start, single = _scan(text)
    above: dict[int, list[str]] = {}
    new: dict[int, list[str]] = {}
    for a, b, cont in _doc_paragraphs(lines, text_lines):   # a paragraph with a long line: reflowed
        if any(len(ln) > width for ln in lines[a - 1:b]):
            words = " ".join(ln.strip() for ln in lines[a - 1:b])
            new[a] = textwrap.wrap(words, width, initial_indent=_indent(lines[a - 1]), subsequent_indent=cont,
                                   break_long_words=False, break_on_hyphens=False)
            new.update((i, []) for i in range(a + 1, b + 1))
    for i, line in enumerate(lines, 1):
        if len(line) <= width or i in new:
            continue
        body = line
        c = comment_of.get(i)
        if c is not None:
            body = line[:c.start[1]].rstrip()
            first = logical_start.get(i, i)
            above.setdefault(first, []).extend(_comment_lines(c.string, _indent(lines[first - 1]), width))
        if len(body) <= width:
            new[i] = [body]
        elif i in text_lines:
            new[i] = _wrap_text(body, text_lines[i], width)
        elif body.lstrip().startswith("#"):
            new[i] = _comment_lines(body.lstrip(), _indent(body), width)
        else:
            # a value is parenthesised only where the statement ends on its line
            rhs = rhs_of.get(i) if i in single else None
            new[i] = _break_code(body, breaks.get(i, []), rhs, width)
    out: list[str] = []
    for i, line in enumerate(lines, 1):
        out.extend(above.get(i, []))
        out.extend(new.get(i, [line]))
    return "\n".join(out)


def _scan(text: str):
    """Per physical line of ``text``: its trailing comment, its break candidates, the column where
    its assignment's or return's value starts, its docstring continuation column, the first line of
    its logical line; and the logical lines written on one line."""
    toks = list(tokenize.generate_tokens(io.StringIO(text).readline))
    # per physical line (1-based): its trailing comment, the columns where the line may break
    # (col, depth; depth 0 = in a right-hand side that gets parenthesised), the docstring
    # text it belongs to, and the first line of its logical line
    comment_of: dict[int, tokenize.TokenInfo] = {}
    breaks: dict[int, list[tuple[int, float]]] = {}
    rhs_of: dict[int, int] = {}                       # line -> column where its assignment's value starts
    text_lines: dict[int, int | None] = {}            # docstring line -> continuation column (None: own)
    logical_start: dict[int, int] = {}
    depth = fstring = 0
    opened: list[str] = []
    targets: list[int] = []                           # the depths of the loop targets open
    single: set[int] = set()                          # the logical lines of one physical line
    returns: set[int] = set()                         # the lines that start with a return
    start = None
    prev = None                                       # the previous significant token
    logical: list[tokenize.TokenInfo] = []
    skip = (tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT, tokenize.NEWLINE,
            tokenize.ENDMARKER)
    for tok in toks:
        if start is None and tok.type not in skip:
            start = tok.start[0]
        if start is not None:
            for ln in range(tok.start[0], tok.end[0] + 1):
                logical_start.setdefault(ln, start)
        name = tokenize.tok_name[tok.type]
        fstring += (name == "FSTRING_START") - (name == "FSTRING_END")
        if not fstring and tok.type in (tokenize.OP, tokenize.NAME):
            s_ = tok.string
            line = tok.start[0]
            if s_ in "([{" and tok.type == tokenize.OP:
                depth += 10 if s_ == "[" else 1     # break inside a subscript only as a last resort
                opened.append(s_)
            elif s_ in ")]}" and tok.type == tokenize.OP:
                depth -= 10 if opened.pop() == "[" else 1
            elif s_ == "for" and tok.type == tokenize.NAME:
                if depth >= 1 and _after_operand(prev, line):      # a comprehension's
                    breaks.setdefault(line, []).append((tok.start[1], depth + BREAK_BEFORE[s_]))
                targets.append(depth)               # no break inside a loop's target
            elif s_ == "in" and tok.type == tokenize.NAME and targets and targets[-1] == depth:
                targets.pop()
            elif targets:
                pass
            elif s_ == "," and (depth >= 1 or (line in rhs_of and line not in returns)):
                breaks.setdefault(line, []).append((tok.end[1], depth))
            elif s_ in BREAK_BEFORE and (depth >= 1 or line in rhs_of) and _after_operand(prev, line):
                breaks.setdefault(line, []).append((tok.start[1], depth + BREAK_BEFORE[s_]))
            elif s_ == "=" and depth == 0 and tok.type == tokenize.OP and start == line \
                    and line not in rhs_of:
                rhs_of[line] = tok.end[1] + 1
            if s_ == "return" and tok.type == tokenize.NAME and not logical:   # its value, as an rhs
                rhs_of[line] = tok.end[1] + 1   # (broken at its operators; a tuple at its commas)
                returns.add(line)
        if tok.type == tokenize.COMMENT and prev is not None and prev.end[0] == tok.start[0]:
            comment_of[tok.start[0]] = tok
        if tok.type not in skip:
            logical.append(tok)
        if tok.type == tokenize.NEWLINE:
            if start == tok.start[0]:
                single.add(start)
            if len(logical) == 1 and logical[0].type == tokenize.STRING:     # a docstring
                doc = logical[0]
                for ln in range(doc.start[0], doc.end[0] + 1):
                    text_lines[ln] = doc.start[1] if ln > doc.start[0] else None
            start, logical = None, []
        if tok.type not in skip:
            prev = tok
    return comment_of, breaks, rhs_of, text_lines, logical_start, single


def _rejoin(text: str, width: int) -> str:
    """``text`` with each statement written on several lines, one of them too long, joined into one
    line (for :func:`_layout` to break afresh at its loosest operators), unless a comment or a
    string spans its inner lines."""
    lines = text.split("\n")
    start, kept, comments = None, True, []
    spans = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in (tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            continue
        if start is None and tok.type not in (tokenize.COMMENT, tokenize.NEWLINE):
            start, kept, comments = tok.start[0], True, []
        if tok.type == tokenize.NEWLINE:
            end = tok.start[0]           # (a comment at the end of the last line goes along)
            if start is not None and kept and end > start and all(c == end for c in comments) \
                    and any(len(ln) > width for ln in lines[start - 1:end]):
                spans.append((start, end))
            start = None
        elif start is not None and tok.type == tokenize.COMMENT:
            comments.append(tok.start[0])
        elif start is not None and tok.end[0] > tok.start[0]:
            kept = False                 # a string over several lines
    for a, b in reversed(spans):
        joined = lines[a - 1].rstrip()
        for ln in lines[a:b]:
            part = ln.strip()
            glue = "" if joined.endswith(("(", "[", "{")) or part.startswith((")", "]", "}")) else " "
            joined += glue + part
        lines[a - 1:b] = [joined]
    return "\n".join(lines)


_ITEM = re.compile(r"\s*([*+-]\s|\d+[.)]\s)")     # a list item: its lines hang below its text
_FIXED = re.compile(r"\s*(>>>|\.\.\.|[|])")         # an example or a table row: kept as written


def _doc_paragraphs(lines: list[str], text_lines: dict) -> list[tuple[int, int, str]]:
    """(first, last, continuation indent) of each docstring paragraph of several lines: the lines
    of one docstring at one indentation (the docstring's own after its first line; a list item's
    hanging one after the item's first line), up to a blank line, the next list item, an example
    or a table row."""
    out, i, n = [], 1, len(lines)
    while i <= n:
        line = lines[i - 1]
        if i not in text_lines or not line.strip() or _FIXED.match(line.lstrip('"')):
            i += 1
            continue
        if text_lines[i] is None and text_lines.get(i + 1) is not None:   # the docstring's first line
            cont = " " * text_lines[i + 1]
        elif _ITEM.match(line) and i < n and len(_indent(lines[i])) > len(_indent(line)):
            cont = _indent(lines[i])
        else:
            cont = _indent(line)
        j = i
        while j < n and text_lines.get(j + 1) is not None and lines[j].strip() and _indent(lines[j]) == cont \
                and not _ITEM.match(lines[j]) and not _FIXED.match(lines[j]) \
                and not lines[j - 1].rstrip().endswith(('"""', "'''")):
            j += 1
        if j > i:
            out.append((i, j, cont))
        i = j + 1
    return out


def _after_operand(prev, line: int) -> bool:
    """Does the previous token end an operand on this line (so that what follows is binary)?"""
    return prev is not None and (prev.type in OPERAND_END or prev.string in ")]}") and prev.end[0] == line


def _indent(line: str) -> str:
    return line[:len(line) - len(line.lstrip())]


def _comment_lines(comment: str, indent: str, width: int) -> list[str]:
    text = comment.lstrip("#").strip()
    return [indent + "# " + part for part in
            textwrap.wrap(text, max(20, width - len(indent) - 2), break_long_words=False,
                          break_on_hyphens=False)] or [indent + "#"]


def _wrap_text(line: str, doc_col: int | None, width: int) -> list[str]:
    """A line of docstring text wrapped at spaces; continuation lines at the docstring's
    indentation (its first line's column), or at this line's own where that is deeper."""
    indent = _indent(line)
    cont = " " * doc_col if doc_col is not None else indent
    cont = indent if len(indent) > len(cont) else cont      # an indented entry goes on as indented
    parts = textwrap.wrap(line.strip(), max(20, width - len(cont)), break_long_words=False,
                          break_on_hyphens=False, initial_indent="", subsequent_indent="")
    if not parts:
        return [line]
    return [indent + parts[0]] + [cont + p for p in parts[1:]]


def _break_code(line: str, cands: list[tuple[int, float]], rhs: int | None, width: int) -> list[str]:
    """Break ``line`` at the candidate columns (after a comma, before an operator), each piece
    as long as fits, shallow brackets and loose operators first (a candidate's depth: its bracket
    depth plus its operator's :data:`BREAK_BEFORE` rank).  A candidate of depth 0 lies in an assignment's
    value, which is then parenthesised (``x = (...)``), so that every break is inside brackets."""
    if rhs is not None and any(d < 1 for _, d in cands):
        line = line[:rhs] + "(" + line[rhs:] + ")"
        cands = [(c + 1, d + 1) for c, d in cands]
    cands = [(c, d) for c, d in cands if d >= 1]
    cont = " " * (len(_indent(line)) + CONTINUATION)
    pieces: list[str] = []
    start, prefix = 0, ""

    def piece(a: int, b: int) -> str:
        return (prefix + line[a:b].strip()) if a else line[:b].rstrip()

    while len(piece(start, len(line))) > width:
        later = [(c, d) for c, d in cands if start < c < len(line) and line[start:c].strip()]
        if not later:
            break
        fits = [(c, d) for c, d in later if len(piece(start, c)) <= width]
        if fits:
            shallow = min(d for _, d in fits)
            cut = max(c for c, d in fits if d == shallow)
        else:
            cut = later[0][0]
        pieces.append(piece(start, cut))
        start, prefix = cut, cont
    pieces.append(piece(start, len(line)))
    return pieces


def _normalised_ast(text: str) -> str:
    tree = ast.parse(text)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            body[0].value.value = " ".join(body[0].value.value.split())
    return ast.dump(tree)
