"""A run that crashed or hung: which rank failed on its own, why, and on which line.

When one rank fails, the others usually fail a moment later with a connection error ("Connection
closed by peer"): that is news about the first rank, not a mistake of theirs. So the failing
rank's own error comes first. A rank still running long after another has finished waits in a
collective the other never called: its stack (the probe writes it on SIGUSR1) shows where.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field

PROBE_FILE = "selfcheck/probe.py"
# Errors that only say another rank went away (gloo, NCCL, the c10d store)
PEER_ERRORS = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|ECONNRESET|"
    r"recvBytes|sendBytes|Socket Timeout|failed to recv|NCCL communicator was aborted|"
    r"DistNetworkError|Connection refused|The server socket has failed|"
    r"Timed out waiting|timed out|Timeout|Read error|Failed to recv", re.I)


@dataclass
class Failure:
    rank: int | None           # the rank whose own error this is
    kind: str                  # "error", "exit", "hung", "timeout", "killed"
    message: str               # one line
    frames: list = field(default_factory=list)   # the script's own frames, innermost last
    line: int | None = None    # the innermost line of the script on the way to the error
    func: str | None = None
    callee: str | None = None  # what that line called on the way to the error (a helper's name)
    others: dict = field(default_factory=dict)   # rank -> one line, for the other ranks
    peers: list = field(default_factory=list)    # the other ranks' own Failures, in order
    silent: bool = False       # exited (sys.exit, a code) without a word: its line says little

    @property
    def peer(self) -> bool:
        return bool(PEER_ERRORS.search(self.message))

    @property
    def waiting(self) -> bool:
        """It waited in a collective (hung, or the wait broke off): news about the ranks'
        order of calls, not about its own line."""
        return self.kind in ("hung", "timeout") or self.peer

    def where(self) -> str:
        return f" (line {self.line}, in {self.func})" if self.line else ""


def last_error_line(output: str) -> str | None:
    lines = [l for l in output.splitlines()
             if re.match(r"^(\[rank\d+\] )?(\w+\.)*\w*(Error|Exception)\b", l)
             or l.startswith("error:") or ": error: " in l]  # the last: argparse's
    if not lines:  # a C++ exception that ended the process (gloo: "what():  [enforce fail ...")
        lines = [l.split("what():", 1)[1] for l in output.splitlines() if "what():" in l]
    return lines[-1].strip() if lines else None


def first_line(message: str) -> str:
    """The error's first line, with a module's repr that starts there closed ("... forward:
    ModuleDict(" becomes "... forward: ModuleDict(...)"): the lines after it are the module."""
    if not message.strip():
        return message
    lines = [l for l in message.strip().splitlines() if l.strip()]
    # "RuntimeError: " with torch's text on the lines after it: the first of those says what
    line = (lines[0].rstrip() + " " + lines[1].strip() if len(lines) > 1 and re.fullmatch(
        r"[\w.]+:", lines[0].strip()) else lines[0])[:300]
    opened = {"(": ")", "[": "]", "{": "}"}
    if line and line[-1] in opened:
        line += "..." + opened[line[-1]]
    return line


def stack_frames(stack: str) -> list[dict]:
    """All frames of a faulthandler dump, outermost first (it lists the innermost first)."""
    frames = [{"file": m.group(1), "line": int(m.group(2)), "func": m.group(3)}
              for m in re.finditer(r'File "([^"]+)", line (\d+) in (\S+)', stack)]
    return frames[::-1]


# torch's frames between a call and what it calls (dist.broadcast's logger, a module's __call__)
PASSING = {"wrapper", "_wrapped_call_impl", "_call_impl", "inner", "decorate_context"}


def script_part(frames: list[dict], script: str) -> tuple[list[dict], str | None]:
    """The script's own frames (outermost first), and the function its innermost one called."""
    frames = [f for f in frames if not f["file"].endswith(PROBE_FILE)]  # its wrappers
    mine = [i for i, f in enumerate(frames) if f["file"] == script]
    if not mine:
        return [], None
    last = mine[-1]
    called = [f["func"] for f in frames[last + 1:]]
    callee = next((c for c in called if c not in PASSING), called[0] if called else None)
    return [frames[i] for i in mine], callee


def rank_failure(run, rank: int) -> Failure | None:
    record = run.ranks[rank] if rank < len(run.ranks) else None
    ended = run.ended.get(rank, "exit 0")
    script = str(run.script.resolve())
    if ended in ("hung", "timeout", "stopped"):
        frames, callee = script_part(stack_frames(run.stacks[rank]), script)
        innermost = frames[-1] if frames else {}
        kind = {"stopped": "killed"}.get(ended, ended)
        message = {"hung": "still waiting long after another rank had finished",
                   "timeout": "no end within the time limit",
                   "killed": "stopped after another rank failed"}[kind]
        return Failure(rank, kind, message, frames, innermost.get("line"), innermost.get("func"),
                       callee)
    if record and record.get("error"):
        error = record["error"]
        message = error["message"] or last_error_line(run.outputs[rank])
        silent = not message
        message = first_line(message or f"exited (code {ended.split()[-1]}) without a message")
        if re.fullmatch(r"[\w.]+(Error|Exception):?\s*", message) and error["frames"]:
            # an error without a text (torch's bare asserts): where it was raised says more
            raised = error["frames"][-1]["file"].replace("\\", "/").split("site-packages/")[-1]
            message = f"{message.strip().rstrip(':')} (raised in {raised})"
        frames, callee = script_part(error["frames"], script)
        innermost = frames[-1] if frames else {}
        return Failure(rank, "exit" if error["exit"] else "error", message, frames,
                       innermost.get("line"), innermost.get("func"), callee, silent=silent)
    if ended != "exit 0":
        message = last_error_line(run.outputs[rank]) or f"ended with {ended} and no message"
        if ended.startswith("exit -"):  # died of a signal on its own (gloo aborts on some
            # errors): the probe's faulthandler wrote where it was
            frames, callee = script_part(stack_frames(run.stacks[rank]), script)
            innermost = frames[-1] if frames else {}
            return Failure(rank, "signal", f"killed by signal {ended.split('-')[-1]} "
                           f"({message})", frames, innermost.get("line"), innermost.get("func"),
                           callee)
        return Failure(rank, "killed", message)
    if record is None:
        return Failure(rank, "killed", last_error_line(run.outputs[rank]) or "no record written")
    return None


def analyse(run) -> Failure | None:
    """The failure to report for `run`, or None if every rank finished."""
    failures = {r: f for r in range(len(run.ranks)) if (f := rank_failure(run, r))}
    if not failures:
        if run.summary is None:
            return Failure(None, "exit", "the run finished without writing summary.json")
        return None
    order = sorted(failures.values(), key=lambda f: (
        f.kind in ("killed",),          # stopped by us after another rank failed: last
        f.peer,                         # a connection error is news about another rank
        f.kind in ("hung", "timeout"),  # an error beats waiting
        f.rank))
    first = order[0]
    first.others = {f.rank: f.message for f in order[1:]}
    first.peers = order[1:]
    return first


def lost_import(message: str, source: str, text: str) -> tuple[str, int | None] | None:
    """A NameError for a name the exercise as shipped imports and the file imports no longer
    (an import line done before the TODO that replaces the name's use): (the name, the TODO
    whose lines imported it, None for a line of no TODO)."""
    from selfcheck.status import parse_blocks
    m = re.search(r"name '(\w+)' is not defined", message)
    if not m:
        return None
    shipped, owner = [], []
    for kind, payload in parse_blocks(source):
        todo, lines = (None, [payload]) if kind == "text" else payload
        shipped += lines
        owner += [todo] * len(lines)

    def imports(code):
        found = {}
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for a in node.names:
                    found.setdefault(a.asname or a.name.split(".")[0], node.lineno)
        return found
    try:
        was, now = imports("".join(shipped)), imports(text)
    except SyntaxError:
        return None
    name = m.group(1)
    if name not in was or name in now:
        return None
    return name, owner[was[name] - 1]


def lost_import_cause(name: str, imported_by: int | None, line: int | None,
                      used_by: int | None) -> str:
    """What to do about a name whose import went before its use (lost_import)."""
    where = f"TODO {imported_by}'s import lines" if imported_by else "the imports"
    until = (f" until TODO {used_by} replaces that use" if used_by and used_by != imported_by
             else " while the script uses it")
    return (f"{name} is no longer imported ({where}), but line {line} still uses it: keep "
            f"its import{until}")
