"""The check's answer: exactly one line per TODO, in TODO order.

    ok           TODO 5 (DDP): both ranks end with the same weights
    FIX          TODO 8 (evaluation over ranks): evaluate() returned ... : add up ...
    not started  TODO 11 (destroy_process_group)
    not checked  TODO 9 (print0): the run stopped before it could be (fix TODO 8 above first)
    not checked  TODO 24 (apply_tp): nothing calls it yet; it is checked once TODO 28 is done

A TODO is "not started" when what it should do does not happen and its code is still as
shipped (and the script shows no attempt at it); a wrong attempt is FIX. Every FIX names what to
change. Lines after the TODOs point to the full output and the hints.
"""

from __future__ import annotations

OK, FIX, NEEDED = "ok", "FIX", "needed"


class Report:
    def __init__(self, names: dict, status: dict, callers: dict | None = None):
        self.names, self.status = names, status
        self.callers = callers or {}   # TODO -> the TODO whose code calls the function it writes
        self.verdicts: dict[int, list[tuple[str, str]]] = {n: [] for n in names}
        self.attempted: set[int] = set()   # behaviour shows an attempt, whatever the text says
        self.notes: list[str] = []
        self.waiting: dict[int, str] = {}   # TODO -> why it cannot be judged yet
        self.after: dict[tuple[int, str], int] = {}  # (TODO, needed text) -> the TODO before
        self.items: dict[str, list[tuple[str, str]]] = {}  # no TODO's: label -> verdicts

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

    def needed(self, todo: int, text: str, after: int | None = None) -> None:
        """The run stops because `todo` is not done yet: shown as "not started", with why.
        after: the TODO whose change made the run reach it ("now that TODO 57 is done", or
        "is changed" while that TODO still has a FIX)."""
        self.verdicts.setdefault(todo, []).append((NEEDED, text))
        if after is not None:
            self.after[(todo, text)] = after

    def reached_otherwise(self, todo: int) -> None:
        """`todo`'s run stops for another reason than the TODO done before it (an import
        removed early): its line names no TODO the run got there by."""
        self.after = {k: v for k, v in self.after.items() if k[0] != todo}

    def note(self, text: str) -> None:
        self.notes.append(text)

    def item(self, label: str, good: bool, text: str) -> None:
        """A line of its own for something that is no TODO (a job file the step uses): ok, or
        FIX with what to change. Shown after the TODOs."""
        self.items.setdefault(label, []).append((OK if good else FIX, text))

    def failed(self, todo: int) -> bool:
        return any(kind in (FIX, NEEDED) for kind, _ in self.verdicts.get(todo, []))

    def judged(self, todo: int) -> bool:
        return bool(self.verdicts.get(todo))

    def not_started(self, todo: int) -> bool:
        """What the TODO should do did not happen, and nothing shows it was started."""
        return (self.status.get(todo) == "not started" and todo not in self.attempted
                and not any(kind == OK for kind, _ in self.verdicts.get(todo, [])))

    def needed_text(self, todo: int, text: str) -> str:
        after = self.after.get((todo, text))
        if after is None or not self.judged(after):  # (not checked: no news of how it ran)
            return text
        state = "done" if self.judged(after) and not self.failed(after) else "changed"
        return f"{text} (the run gets here now that TODO {after} is {state})"

    def unchecked(self, todo: int, reason: str | None) -> str:
        """Why `todo` could not be judged: nothing calls its code until a later TODO is done, or
        the run stopped at the FIX (or not started) line of another TODO, named where it stands
        (above or below). A TODO not started yet is waited for, not fixed."""
        if reason is not None:
            return reason
        caller = self.callers.get(todo)
        if caller is not None and self.not_started(caller):
            return (f"nothing calls it yet; it is checked once TODO {caller} "
                    f"({self.names.get(caller, '')}) is done")
        stops = [n for n in sorted(self.verdicts) if self.failed(n)]
        if not stops:
            return "the run never got to it"
        above = [n for n in stops if n < todo]
        first = above[-1] if above else stops[0]
        where = "above" if first < todo else "below"
        if self.not_started(first):
            return (f"the run stops at TODO {first} {where}, not started yet; it is checked "
                    f"once TODO {first} is done")
        return f"the run stopped before it could be (fix TODO {first} {where} first)"

    def render(self, unchecked_reason: str | None = None) -> tuple[list[str], int]:
        lines, problems = [], 0
        for todo in sorted(self.verdicts):
            entries = self.verdicts[todo]
            fixes = [text for kind, text in entries if kind == FIX]
            needed = [text for kind, text in entries if kind == NEEDED]
            if needed and not fixes:
                problems += 1
                lines.append(f"  {'not started':<12} {self.label(todo)}: "
                             f"{self.needed_text(todo, needed[0])}")
            elif self.not_started(todo) and (fixes or not entries):
                problems += 1
                lines.append(f"  {'not started':<12} {self.label(todo)}")
            elif fixes:
                problems += 1
                unique = list(dict.fromkeys(fixes))
                text = unique[0] + "".join(f"; also {t}" for t in unique[1:3])
                lines.append(f"  {FIX:<12} {self.label(todo)}: {text}")
            elif entries and todo in self.waiting:
                # part of it works, the rest cannot be judged yet: not ok until it is
                problems += 1
                why = self.waiting[todo].removeprefix("not checked: ")
                lines.append(f"  {'not checked':<12} {self.label(todo)}: {why} "
                             f"(so far: {entries[0][1]})")
            elif entries:
                oks = list(dict.fromkeys(text for _, text in entries))
                lines.append(f"  {OK:<12} {self.label(todo)}: {'; '.join(oks[:2])}")
            else:
                problems += 1
                why = self.waiting.get(todo) or self.unchecked(todo, unchecked_reason)
                why = why.removeprefix("not checked: ")  # the line says so already
                lines.append(f"  {'not checked':<12} {self.label(todo)}: {why}")
        for label, entries in self.items.items():
            fixes = list(dict.fromkeys(text for kind, text in entries if kind == FIX))
            if fixes:
                problems += 1
                lines.append(f"  {FIX:<12} {label}: {fixes[0]}"
                             + "".join(f"; also {t}" for t in fixes[1:3]))
            else:
                lines.append(f"  {OK:<12} {label}: {entries[0][1]}")
        # one line per TODO, whatever a text holds (a variable with a newline in it)
        return [" ".join(line.splitlines()) for line in lines], problems
