"""The check's answer: exactly one line per TODO, in TODO order.

    ok           TODO 5 (DDP): both ranks end with the same weights
    FIX          TODO 8 (evaluation over ranks): evaluate() returned ... : add up ...
    not started  TODO 11 (destroy_process_group)
    not checked  TODO 9 (print0): the run stopped before (see the FIX lines)

A TODO is "not started" when what it should do does not happen and its code is still as
shipped (and the script shows no attempt at it); a wrong attempt is FIX. Every FIX names what to
change. Lines after the TODOs point to the full output and the hints.
"""

from __future__ import annotations

OK, FIX, NEEDED = "ok", "FIX", "needed"


class Report:
    def __init__(self, names: dict, status: dict):
        self.names, self.status = names, status
        self.verdicts: dict[int, list[tuple[str, str]]] = {n: [] for n in names}
        self.attempted: set[int] = set()   # behaviour shows an attempt, whatever the text says
        self.notes: list[str] = []
        self.waiting: dict[int, str] = {}   # TODO -> why it cannot be judged yet

    def label(self, todo) -> str:
        return f"TODO {todo} ({self.names[todo]})" if todo in self.names else f"TODO {todo}"

    def ok(self, todo: int, text: str) -> None:
        self.verdicts.setdefault(todo, []).append((OK, text))

    def fail(self, todo: int, text: str) -> None:
        self.verdicts.setdefault(todo, []).append((FIX, text))

    def attempt(self, todo: int) -> None:
        self.attempted.add(todo)

    def waits(self, todo: int, text: str) -> None:
        """`todo` can only be judged once another TODO uses it: say which."""
        self.waiting[todo] = text

    def needed(self, todo: int, text: str) -> None:
        """The run stops because `todo` is not done yet: shown as "not started", with why."""
        self.verdicts.setdefault(todo, []).append((NEEDED, text))

    def note(self, text: str) -> None:
        self.notes.append(text)

    def failed(self, todo: int) -> bool:
        return any(kind in (FIX, NEEDED) for kind, _ in self.verdicts.get(todo, []))

    def judged(self, todo: int) -> bool:
        return bool(self.verdicts.get(todo))

    def not_started(self, todo: int) -> bool:
        """What the TODO should do did not happen, and nothing shows it was started."""
        return (self.status.get(todo) == "not started" and todo not in self.attempted
                and not any(kind == OK for kind, _ in self.verdicts.get(todo, [])))

    def render(self, unchecked_reason: str = "not checked: the run stopped before it could "
               "be (fix the FIX line above first)") -> tuple[list[str], int]:
        lines, problems = [], 0
        for todo in sorted(self.verdicts):
            entries = self.verdicts[todo]
            fixes = [text for kind, text in entries if kind == FIX]
            needed = [text for kind, text in entries if kind == NEEDED]
            if needed and not fixes:
                problems += 1
                lines.append(f"  {'not started':<12} {self.label(todo)}: {needed[0]}")
            elif self.not_started(todo) and (fixes or not entries):
                problems += 1
                lines.append(f"  {'not started':<12} {self.label(todo)}")
            elif fixes:
                problems += 1
                unique = list(dict.fromkeys(fixes))
                text = unique[0] + "".join(f"; also {t}" for t in unique[1:3])
                lines.append(f"  {FIX:<12} {self.label(todo)}: {text}")
            elif entries:
                oks = list(dict.fromkeys(text for _, text in entries))
                lines.append(f"  {OK:<12} {self.label(todo)}: {'; '.join(oks[:2])}")
            else:
                problems += 1
                why = self.waiting.get(todo, unchecked_reason)
                lines.append(f"  {'not checked':<12} {self.label(todo)}: {why}")
        return lines, problems
