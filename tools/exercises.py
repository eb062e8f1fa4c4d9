"""Make the exercise files and their solutions from one marked source each.

Each file under course/ is the single source of one exercise. It contains both versions of
every TODO block:

    # TODO 5: Wrap the model in DistributedDataParallel ...
    #| exercise
    (what participants start from; may be empty)
    #| solution
    (the answer)
    #| end

From course/<path> this tool writes <path> (the exercise: the `exercise` parts) and
solutions/<path> (the solution: the `solution` parts, with "TODO N" comments turned into
"DONE N"). So `diff -u <path> solutions/<path>` shows exactly the TODO blocks.

    python tools/exercises.py           # write train/, *.sbatch and solutions/ from course/
    python tools/exercises.py --check   # exit 1 if a committed file differs from its source

Your edits are never lost: before it rewrites an exercise file (train/*.py, the root *.sbatch)
that holds changes neither git nor this tool made, the tool copies it to backups/<time>/ (git
ignores that folder; a second run within the same second gets backups/<time>-2/) and prints one
warning line per file.

TODO numbers are unique across the whole course (one number may mark several blocks of the
same task in one file), so a slide or a question can name "TODO 14" without ambiguity, and
they run from 1 without gaps in the order of the course.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TODO = re.compile(r"\bTODO (\d+)\b")
MARKERS = ("#| exercise", "#| solution", "#| end")


class SourceError(ValueError):
    pass


def render(text: str, variant: str, name: str = "<source>") -> str:
    """The exercise or solution version of a marked source."""
    assert variant in ("exercise", "solution")
    out, state = [], None  # state: None outside a block, else the part being read
    for lineno, line in enumerate(text.splitlines(keepends=True), 1):
        marker = line.strip()
        if marker in MARKERS:
            expected = {None: "#| exercise", "exercise": "#| solution", "solution": "#| end"}[state]
            if marker != expected:
                raise SourceError(f"{name}:{lineno}: found {marker!r}, expected {expected!r}")
            state = {"#| exercise": "exercise", "#| solution": "solution", "#| end": None}[marker]
            continue
        if state in (None, variant):
            if variant == "solution":
                line = TODO.sub(r"DONE \1", line)
            out.append(line)
    if state is not None:
        raise SourceError(f"{name}: a block opened with '#| exercise' is never closed with '#| end'")
    return "".join(out)


def sources(root: Path = ROOT) -> list[Path]:
    return sorted(p for p in (root / "course").rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts)


def targets(source: Path, root: Path = ROOT) -> dict[str, Path]:
    rel = source.relative_to(root / "course")
    return {"exercise": root / rel, "solution": root / "solutions" / rel}


def committed_text(root: Path, rel: Path) -> str | None:
    """The file as git's HEAD has it (None outside a git checkout or for a new file)."""
    try:
        proc = subprocess.run(["git", "show", f"HEAD:{rel.as_posix()}"], cwd=root,
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def backup_stamp(root: Path) -> str:
    """backups/<time>, or <time>-2, -3... if a run within the same second made that folder
    already (two runs in one second would otherwise copy into one folder, the second
    overwriting the first's backup of a file edited in between)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name, n = stamp, 1
    while (root / "backups" / name).exists():
        n += 1
        name = f"{stamp}-{n}"
    return name


def back_up(root: Path, target: Path, stamp: str) -> Path:
    """Copy a participant's edited exercise file to backups/<stamp>/ before it is rewritten."""
    rel = target.relative_to(root)
    backup = root / "backups" / stamp / rel
    backup.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(target, backup)
    return backup


def todo_numbers(text: str) -> set[int]:
    return {int(n) for n in TODO.findall(text)}


def check_numbering(files: dict[Path, str]) -> list[str]:
    """Numbers used by more than one source file, or missing (empty when fine)."""
    problems, owner = [], {}
    for path, text in files.items():
        for n in todo_numbers(text):
            if n in owner:
                problems.append(f"TODO {n} is used in both {owner[n].name} and {path.name}")
            owner[n] = path
    missing = sorted(set(range(1, max(owner, default=0) + 1)) - set(owner))
    if missing:
        problems.append(f"TODO numbers must run from 1 without gaps; missing: {missing}")
    return problems


def main(argv=None, root: Path = ROOT) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="do not write; fail if a committed file differs from its source")
    args = parser.parse_args(argv)
    texts = {src: src.read_text() for src in sources(root)}
    problems = check_numbering(texts)
    stamp = backup_stamp(root)
    record = root / "backups" / "written.json"  # what this tool wrote last: not your edits
    written = json.loads(record.read_text()) if record.is_file() else {}
    for src, text in texts.items():
        for variant, target in targets(src, root).items():
            try:
                wanted = render(text, variant, str(src.relative_to(root)))
            except SourceError as e:
                problems.append(str(e))
                continue
            rel = target.relative_to(root)
            if args.check:
                if not target.is_file() or target.read_text() != wanted:
                    problems.append(f"{rel} differs from course/{src.relative_to(root / 'course')}: "
                                    "edit the source, then run `python tools/exercises.py`")
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                if not target.is_file() or target.read_text() != wanted:
                    current = target.read_text() if target.is_file() else None
                    if (variant == "exercise" and current is not None
                            and digest(current) != written.get(rel.as_posix())
                            and current != committed_text(root, rel)):
                        backup = back_up(root, target, stamp)
                        print(f"warning: {rel} had edits of yours: saved as "
                              f"{backup.relative_to(root)} before rewriting it", file=sys.stderr)
                    target.write_text(wanted)
                    if variant == "exercise":
                        written[rel.as_posix()] = digest(wanted)
                    target.chmod(src.stat().st_mode & 0o777)
                    print(f"wrote {rel}")
    if written and not args.check:
        record.parent.mkdir(exist_ok=True)
        record.write_text(json.dumps(written, indent=1, sort_keys=True) + "\n")
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
