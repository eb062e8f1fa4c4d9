"""The participant's file next to the exercise as shipped: which TODOs were touched, and which
TODO a line of the file belongs to.

Neither decides whether a TODO works: the checks judge behaviour. The text only tells a TODO
nobody has touched yet ("not started") from a wrong attempt ("FIX"), and names the TODO of the
line a crash happened on.
"""

from __future__ import annotations

import ast
import difflib
import re
from functools import cached_property

TODO_COMMENT = re.compile(r"^\s*#\s*TODO (\d+)\b")  # a TODO comment, not a mention


def parse_blocks(source: str):
    """The course source split into ("text", line) and ("block", (todo, exercise lines))."""
    items, state, todo, ex = [], None, None, []
    for line in source.splitlines(keepends=True):
        m = line.strip()
        if m == "#| exercise":
            state, ex = "exercise", []
            continue
        if m == "#| solution":
            state = "solution"
            continue
        if m == "#| end":
            items.append(("block", (todo, ex)))
            state = None
            continue
        if state is None:
            found = TODO_COMMENT.match(line)
            if found:
                todo = int(found.group(1))
            items.append(("text", line))
        elif state == "exercise":
            ex.append(line)
    return items


class Ownership:
    """The exercise as shipped, lined up against the participant's file."""

    def __init__(self, source: str, text: str):
        self.source = source
        items = parse_blocks(source)
        shipped, owner, gaps = [], [], {}  # gaps: position of an empty block -> its TODOs
        comment_todo = []                  # the TODO comment above each shipped line
        current = None
        for kind, payload in items:
            if kind == "text":
                found = TODO_COMMENT.match(payload)
                current = int(found.group(1)) if found else current
                shipped.append(payload)
                owner.append(None)
                comment_todo.append(current)
            else:
                n, lines = payload
                if n is None:  # a block above every TODO (what the exercise starts from): nobody's
                    shipped += lines
                    owner += [None] * len(lines)
                    comment_todo += [current] * len(lines)
                    continue
                if not lines:
                    gaps.setdefault(len(shipped), []).append(n)
                shipped += lines
                owner += [n] * len(lines)
                comment_todo += [n] * len(lines)
        self.todos = sorted({p[0] for kind, p in items if kind == "block" and p[0] is not None})
        mine = text.splitlines(keepends=True)
        self.line_owner: dict[int, int | None] = {}  # 1-based line of `text` -> TODO
        self.touched: set[int] = set()
        matcher = difflib.SequenceMatcher(None, shipped, mine, autojunk=False)
        for op, i1, i2, j1, j2 in matcher.get_opcodes():
            if op == "equal":
                for k in range(i2 - i1):
                    self.line_owner[j1 + k + 1] = owner[i1 + k]
                continue
            touched = {owner[i] for i in range(i1, i2) if owner[i] is not None}
            if op == "insert":  # lines added right before or after a block's own lines edit it
                touched |= {owner[i] for i in (i1 - 1, i1) if 0 <= i < len(owner)} - {None}
            for pos in range(i1, i2 + 1):
                touched |= set(gaps.get(pos, []))
            self.touched |= touched
            # new lines belong to the block they edit, or else to the TODO comment above them
            guess = min(touched) if touched else (comment_todo[i1 - 1] if i1 > 0 else None)
            for j in range(j1, j2):
                self.line_owner[j + 1] = guess

    def status(self) -> dict[int, str]:
        return {n: "edited" if n in self.touched else "not started" for n in self.todos}

    @cached_property
    def _solution_calls(self) -> tuple[dict[str, set], dict[str, int | None]]:
        """In the solution: {name called: the TODOs of its calls (None: shipped code)}, and
        {function defined: the TODO of its def line}."""
        text, owners = solution_text(self.source)
        called: dict[str, set] = {}
        defined: dict[str, int | None] = {}
        try:
            tree = ast.parse(text)
        except SyntaxError:
            return called, defined
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name:
                    called.setdefault(name, set()).add(owners[node.lineno - 1])
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defined[node.name] = owners[node.lineno - 1]
        return called, defined

    def callee_todo(self, name: str | None) -> int | None:
        """The TODO whose solution calls `name`, when only one TODO's code calls it."""
        todos = self._solution_calls[0].get(name or "", set())
        return next(iter(todos)) if len(todos) == 1 and None not in todos else None

    def caller_of(self, todo: int) -> int | None:
        """The TODO whose code calls the function that `todo` writes (apply_tp: the TODO that
        shards the model with it): until that one is done, nothing runs `todo`'s code."""
        called, defined = self._solution_calls
        found = [self.callee_todo(name) for name, n in defined.items() if n == todo]
        return min((n for n in found if n is not None and n != todo), default=None)

    def callers(self) -> dict[int, int]:
        return {n: c for n in self.todos if (c := self.caller_of(n)) is not None}

    def todo_of_line(self, line: int | None) -> int | None:
        return self.line_owner.get(line) if line else None


def solution_text(source: str) -> tuple[str, list[int | None]]:
    """The course source as the solution reads, and the TODO block of each of its lines (None
    outside the blocks)."""
    lines, owners, state, todo = [], [], None, None
    for line in source.splitlines(keepends=True):
        m = line.strip()
        if m in ("#| exercise", "#| solution", "#| end"):
            state = {"#| exercise": "exercise", "#| solution": "solution", "#| end": None}[m]
            continue
        if state is None:
            found = TODO_COMMENT.match(line)
            todo = int(found.group(1)) if found else todo
        if state != "exercise":
            lines.append(line)
            owners.append(todo if state == "solution" else None)
    return "".join(lines), owners


def todo_status(source: str, text: str) -> dict[int, str]:
    """For every TODO number: "not started" (all its blocks as shipped) or "edited"."""
    return Ownership(source, text).status()
