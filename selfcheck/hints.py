"""Hints on demand: `python check.py STEP --hint N`, one level more detailed each time.

    level 1  what the TODO is for and which idea it uses (no code)
    level 2  which function or class, where it comes from, and its important arguments
    level 3  the solution's lines, as the course source has them

The TODO comments and slides say what to do and why; the exact lines come only when asked
for. How many hints were asked for is kept in ~/.cache/course-check/hints.json (a participant's
own record; the check prints it with its result).
"""

from __future__ import annotations

import json
from pathlib import Path

from selfcheck.runs import cache_root

ROOT = Path(__file__).resolve().parents[1]
LEVELS = 3


def state_file() -> Path:
    return cache_root() / "hints.json"


def load() -> dict:
    try:
        return json.loads(state_file().read_text())
    except (OSError, ValueError):
        return {}


def save(state: dict) -> None:
    path = state_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(path)


def used(step: str) -> str:
    state = load().get(step, {})
    if not state:
        return ""
    parts = [f"TODO {n}: {level} level{'s' if level > 1 else ''}"
             for n, level in sorted(state.items(), key=lambda kv: int(kv[0]))]
    return f"{sum(state.values())} ({', '.join(parts)})"


def solution_lines(step_file: str, todo: int) -> str:
    from selfcheck.steps.common import solution_blocks
    source = (ROOT / "course" / step_file).read_text()
    blocks = ["".join(lines).rstrip("\n") for n, lines in solution_blocks(source) if n == todo]
    blocks = [b for b in blocks if b.strip()]
    return "\n    ...\n".join(blocks) if blocks else "(this TODO's solution has no code lines)"


def show(step: str, module, todo: int) -> int:
    if todo not in module.TODOS:
        print(f"error: the {step} step has TODOs {min(module.TODOS)}-{max(module.TODOS)}, "
              f"not {todo}")
        return 2
    state = load()
    mine = state.setdefault(step, {})
    level = min(mine.get(str(todo), 0) + 1, LEVELS)
    mine[str(todo)] = level
    save(state)
    texts = getattr(module, "HINTS", {}).get(todo, ())
    print(f"Hint for TODO {todo} ({module.TODOS[todo]}), level {level} of {LEVELS}:")
    for i in range(1, level + 1):
        if i <= 2 and i <= len(texts):
            print(f"  {i}. {texts[i - 1]}")
        elif i == 3:
            print("  3. the solution's lines:")
            for line in solution_lines(module.FILE, todo).splitlines():
                print(f"       {line}")
    if level < LEVELS:
        print(f"(more detail: python check.py {step} --hint {todo} again)")
    return 0
