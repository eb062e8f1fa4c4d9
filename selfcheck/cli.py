"""python check.py [STEP [FILE]] [--hint N] [--show]: the command participants run."""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import traceback
from pathlib import Path

from selfcheck import hints
from selfcheck.report import Report
from selfcheck.runs import cache_root, write_tiny_text
from selfcheck.status import Ownership
from selfcheck.steps import ORDER, all_steps, step as step_module
from selfcheck.steps.common import Context

ROOT = Path(__file__).resolve().parents[1]

USAGE = """\
Check your own work on a step of the course, at any moment: which TODOs work, which to fix.

    python check.py                    # list the steps
    python check.py ddp                # train/to_distributed_training.py, TODOs 1-11
    python check.py sbatch             # to_distributed_training.sbatch, TODOs 12-16
    python check.py sbatch --show      # what srun would start on every node (a dry run)
    python check.py ddp --hint 5       # a hint for TODO 5; again: a more detailed one
    python check.py ddp path/to/my_copy.py     # another file than the one in train/

It runs YOUR script on a tiny made-up corpus (tiny model, dropout 0, two short epochs), as two
ranks on the CPU (two nodes with one process each where that shows more), next to the
single-process reference, and compares what comes out: losses, evaluation, which samples each
rank read, what each rank printed and saved, the checkpoints, how the model is split. (The
sbatch files run with stand-ins for scontrol, nslookup, srun, torchrun and nsys; in the
performance step torch.compile is recorded, not run: compiling takes minutes on a CPU.)
It prints one line per TODO: ok, not started, or what to fix; exit code 0 only when
everything checked works. It takes a few seconds to half a minute and writes nothing in the
repository (its runs stay in ~/.cache/course-check/last/STEP for you to read).
"""


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        print(f"error: {message}: python check.py STEP [FILE] [--hint N] [--show]")
        raise SystemExit(2)


def list_steps() -> None:
    print(USAGE.split("\n\n")[0])
    print("\nSteps:")
    for name, module in all_steps().items():
        print(f"  python check.py {name:<11} {module.FILE:<33} {module.WHAT}")
    print("\nAfter the step, another file (or folder holding a copy of the repository) to check:"
          "\n  python check.py ddp my_copy.py\nA hint for one TODO (each time one level more "
          "detailed): python check.py ddp --hint 5\nA step's TODOs and options: "
          "python check.py ddp --help")


def step_help(name: str) -> None:
    """`python check.py STEP --help`: the step's file, its TODOs and what to type."""
    module = step_module(name)
    print(f"python check.py {name}: {module.FILE}, {module.WHAT}")
    if module.TODOS:
        print("\nTODOs:")
        for number, what in module.TODOS.items():
            print(f"  {number:>2}  {what}")
    rows = [(f"python check.py {name}", f"checks {module.FILE}"),
            (f"python check.py {name} FILE", "another file, or a folder holding a copy of the "
             "repository")]
    if module.TODOS:
        first = min(module.TODOS)
        rows.append((f"python check.py {name} --hint {first}",
                     f"a hint for TODO {first}; again: a more detailed one"))
    if hasattr(module, "show"):
        rows.append((f"python check.py {name} --show", "what srun would start on every node (a "
                     "dry run)"))
    width = max(len(command) for command, _ in rows)
    print()
    for command, what in rows:
        print(f"  {command:<{width}}  {what}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--probe"]:  # the old entry of the probe, kept for scripts that use it
        from selfcheck.probe import main as probe_main
        probe_main(argv[1:])
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        list_steps()
        return 0
    if argv[0] not in ORDER:
        print(f"error: no step {argv[0]!r}: choose one of {', '.join(ORDER)} "
              "(python check.py lists them)")
        return 2
    if any(a in ("-h", "--help") for a in argv[1:]):
        try:
            step_help(argv[0])
        except BrokenPipeError:  # `python check.py pp --help | head`
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    parser = OneLineParser(prog="check.py", add_help=False)
    parser.add_argument("step")
    parser.add_argument("file", nargs="?")
    parser.add_argument("--hint", type=int, metavar="N")
    parser.add_argument("--show", action="store_true")
    args = parser.parse_args(argv)
    work = cache_root() / "last" / args.step
    try:
        return run_step(args, work)
    except KeyboardInterrupt:
        print("interrupted")
        return 130
    except BrokenPipeError:  # `python check.py ... | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - the check never shows a traceback of its own
        work.mkdir(parents=True, exist_ok=True)
        details = work.parent / f"check-error-{args.step}.txt"
        details.write_text(traceback.format_exc())
        first = (str(e).strip().splitlines() or [""])[0][:200]
        report = getattr(e, "report", None)
        if report is not None:  # what could be judged before the check itself failed
            lines, _ = report.render("not checked: the check stopped before it (see below)")
            print("\n".join(lines))
        print(f"check.py could not finish the {args.step} check ({type(e).__name__}: {first}): "
              f"a problem of the check itself, not a verdict on your file; the details are in "
              f"{details} (please show them to an instructor)")
        return 3


def run_step(args, work: Path) -> int:
    module = step_module(args.step)
    if args.hint is not None:
        return hints.show(args.step, module, args.hint)
    target = Path(args.file) if args.file else ROOT / module.FILE
    if target.is_dir():
        target = target / module.FILE
    target = target.resolve()
    if not target.is_file():
        print(f"error: {target} does not exist: give the file to check, e.g. "
              f"python check.py {args.step} {module.FILE}")
        return 2
    if args.show:
        if not hasattr(module, "show"):
            print(f"error: --show is for the job files (sbatch, perf-sbatch), not {args.step}")
            return 2
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        print("\n".join(module.show(target, work)))
        return 0
    if getattr(module, "NEEDS_TORCH", True) and importlib.util.find_spec("torch") is None:
        print(f"error: this Python ({sys.executable}) has no torch: activate the course's "
              f"environment first, source .venv/bin/activate (setup_env.sh made it), or run "
              f".venv/bin/python check.py {args.step}")
        return 2
    source = (ROOT / "course" / module.FILE).read_text()
    text = target.read_text(errors="replace")
    owner = Ownership(source, text)
    report = Report(module.TODOS, owner.status(), owner.callers())
    ctx = Context(args.step, target, work, source, text, report, owner, root=ROOT)
    what = module.what_of(text) if hasattr(module, "what_of") else module.WHAT
    print(f"Checking {target} ({what}) ...", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    write_tiny_text(work / "data")
    try:
        module.check(ctx)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        e.report = report
        raise
    lines, problems = report.render()
    print("\n".join(lines))
    for note in report.notes:
        print(note)
    used = hints.used(args.step)
    if used:
        print(f"hints used for this step: {used}")
    if problems:
        first = next((n for n in sorted(report.verdicts) if report.failed(n)
                      or report.not_started(n)), None)
        print(f"{problems} thing(s) to do or fix: the FIX and 'not started' lines above."
              + (f" Stuck? python check.py {args.step} --hint {first}" if first else ""))
        return 1
    print("all good")
    return 0
