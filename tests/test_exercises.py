"""Exercises and solutions come from one source each and never drift apart."""

import difflib
import re
import subprocess
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import exercises  # noqa: E402

SOURCE = """\
keep = 1
# TODO 7: Make it parallel, because ...
#| exercise
x = serial()
#| solution
x = parallel()
#| end
after = 2
"""


def test_the_exercise_keeps_the_exercise_part_and_the_todo_comment():
    assert exercises.render(SOURCE, "exercise") == (
        "keep = 1\n# TODO 7: Make it parallel, because ...\nx = serial()\nafter = 2\n")


def test_the_solution_keeps_the_solution_part_and_marks_the_todo_done():
    assert exercises.render(SOURCE, "solution") == (
        "keep = 1\n# DONE 7: Make it parallel, because ...\nx = parallel()\nafter = 2\n")


@pytest.mark.parametrize("broken, message", [
    ("#| exercise\na\n", "never closed"),
    ("#| solution\na\n#| end\n", "expected '#| exercise'"),
    ("#| exercise\na\n#| end\n", "expected '#| solution'"),
])
def test_a_malformed_block_is_reported_with_its_line(broken, message):
    with pytest.raises(exercises.SourceError, match=message):
        exercises.render(broken, "exercise", "course/x.py")


def test_a_todo_number_used_in_two_files_is_reported(tmp_path):
    problems = exercises.check_numbering({tmp_path / "a.py": "# TODO 1: x # TODO 2: x",
                                          tmp_path / "b.sh": "# TODO 2: y"})
    assert problems == ["TODO 2 is used in both a.py and b.sh"]


def test_a_gap_in_the_todo_numbers_is_reported(tmp_path):
    problems = exercises.check_numbering({tmp_path / "a.py": "# TODO 1: x # TODO 3: y"})
    assert problems == ["TODO numbers must run from 1 without gaps; missing: [2]"]


def test_todo_numbers_are_unique_across_the_course_and_run_without_gaps():
    texts = {src: src.read_text() for src in exercises.sources()}
    assert exercises.check_numbering(texts) == []


def test_every_committed_exercise_and_solution_is_what_its_source_gives():
    proc = subprocess.run([sys.executable, "tools/exercises.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_every_course_file_has_an_exercise_and_a_solution_in_the_known_places():
    for src in exercises.sources():
        rel = src.relative_to(ROOT / "course")
        assert (ROOT / rel).is_file() and (ROOT / "solutions" / rel).is_file()


def test_slides_cite_only_todo_numbers_that_exist_and_never_line_numbers():
    import re
    existing = set().union(*(exercises.todo_numbers(s.read_text()) for s in exercises.sources()))
    for slide in (ROOT / "slides").glob("*.md"):
        text = slide.read_text()
        for first, last in re.findall(r"TODO (\d+)(?:\s*[–-]\s*(\d+))?", text):
            cited = range(int(first), int(last or first) + 1)
            assert set(cited) <= existing, f"{slide.name} cites TODO {first}-{last} that do not exist"
        assert not re.search(r"\bline \d+", text, re.IGNORECASE), f"{slide.name} cites a line number"


def untodo_blocks(text: str) -> list[str]:
    """Blocks whose comment right above does not say `TODO N` (the diff would show them)."""
    lines, bad = text.splitlines(), []
    for i, line in enumerate(lines):
        if line.strip() != "#| exercise":
            continue
        j, comment = i - 1, []
        while j >= 0 and lines[j].lstrip().startswith("#") and not lines[j].strip() == "#| end":
            comment.append(lines[j])
            j -= 1
        if not any(re.search(r"\bTODO \d+\b", c) for c in comment):
            nxt = next((l for l in lines[i + 1:] if not l.startswith("#|")), "")
            bad.append(f"line {i + 1}: {nxt.strip()}")
    return bad


@pytest.mark.parametrize("src", exercises.sources(), ids=lambda p: p.name)
def test_exercise_and_solution_differ_only_in_todo_blocks(src):
    """diff -u X solutions/X is the lesson: every changed line sits under a TODO comment, and
    outside the blocks the only change is TODO -> DONE."""
    text = src.read_text()
    assert untodo_blocks(text) == [], f"blocks without a TODO comment above them in {src.name}"
    exercise, solution = (exercises.render(text, v).splitlines() for v in ("exercise", "solution"))
    out, state = [], None  # for every exercise line: did it come from a block?
    for line in text.splitlines():
        if line.strip() in exercises.MARKERS:
            state = {"#| exercise": "exercise", "#| solution": "solution", "#| end": None}[line.strip()]
            continue
        if state is None:
            out.append(False)
        elif state == "exercise":
            out.append(True)
    in_block = out
    assert len(in_block) == len(exercise)
    matcher = difflib.SequenceMatcher(None, [exercises.TODO.sub(r"DONE \1", l) for l in exercise],
                                      solution, autojunk=False)
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        if op == "equal":
            continue
        outside = [exercise[i] for i in range(i1, i2) if not in_block[i]]
        assert not outside, f"{src.name}: lines outside TODO blocks differ: {outside}"
        # inserted solution lines must sit right after a TODO comment or another block line
        above = i1 - 1
        assert above < 0 or in_block[above] or re.search(r"\bTODO \d+\b", exercise[above]) \
            or exercise[above].lstrip().startswith("#"), \
            f"{src.name}: solution lines {solution[j1:j2]} are not under a TODO comment"


def make_course(root):
    (root / "course" / "train").mkdir(parents=True)
    (root / "course" / "train" / "x.py").write_text(SOURCE.replace("TODO 7", "TODO 1"))
    (root / "course" / "x.sbatch").write_text("# TODO 2: go\n#| exercise\n#| solution\nsrun\n#| end\n")


def test_regenerating_backs_up_edited_exercise_files_with_one_warning_each(tmp_path, capsys):
    make_course(tmp_path)
    assert exercises.main([], root=tmp_path) == 0
    (tmp_path / "train" / "x.py").write_text("my own work\n")
    (tmp_path / "x.sbatch").write_text("my job\n")
    (tmp_path / "solutions" / "x.sbatch").write_text("stale solution\n")
    capsys.readouterr()
    assert exercises.main([], root=tmp_path) == 0
    warnings = [l for l in capsys.readouterr().err.splitlines() if l.startswith("warning:")]
    assert len(warnings) == 2 and all("saved as backups/" in w for w in warnings)
    backups = {p.relative_to(tmp_path / "backups").parts[1:]: p.read_text()
               for p in (tmp_path / "backups").rglob("*") if p.is_file() and p.suffix != ".json"}
    assert backups == {("train", "x.py"): "my own work\n", ("x.sbatch",): "my job\n"}
    assert (tmp_path / "train" / "x.py").read_text() == exercises.render(
        (tmp_path / "course" / "train" / "x.py").read_text(), "exercise")


def test_two_regenerations_within_one_second_keep_both_backups(tmp_path, capsys, monkeypatch):
    make_course(tmp_path)
    assert exercises.main([], root=tmp_path) == 0
    monkeypatch.setattr(exercises.time, "strftime", lambda fmt: "20260101-120000")  # one second
    for edit in ("first edit\n", "second edit\n"):
        (tmp_path / "train" / "x.py").write_text(edit)
        assert exercises.main([], root=tmp_path) == 0
    backups = sorted((p.parent.parent.name, p.read_text())
                     for p in (tmp_path / "backups").rglob("x.py"))
    assert backups == [("20260101-120000", "first edit\n"), ("20260101-120000-2", "second edit\n")]


def test_regenerating_unchanged_files_backs_up_nothing(tmp_path, capsys):
    make_course(tmp_path)
    assert exercises.main([], root=tmp_path) == 0
    assert exercises.main([], root=tmp_path) == 0
    assert not [p for p in (tmp_path / "backups").rglob("*") if p.suffix != ".json"]
    assert "warning" not in capsys.readouterr().err


def test_backups_are_ignored_by_git():
    proc = subprocess.run(["git", "check-ignore", "-q", "backups/20260101-000000/train/x.py"],
                          cwd=ROOT, timeout=30)
    assert proc.returncode == 0


def test_regenerating_after_editing_the_course_source_backs_up_nothing(tmp_path, capsys):
    """An instructor edits course/ and regenerates twice: the tool's own output is no one's work."""
    make_course(tmp_path)
    assert exercises.main([], root=tmp_path) == 0
    src = tmp_path / "course" / "train" / "x.py"
    src.write_text(src.read_text().replace("keep = 1", "keep = 2"))
    assert exercises.main([], root=tmp_path) == 0
    src.write_text(src.read_text().replace("keep = 2", "keep = 3"))
    assert exercises.main([], root=tmp_path) == 0
    assert not [p for p in (tmp_path / "backups").rglob("*") if p.suffix == ".py"]
    assert "warning" not in capsys.readouterr().err
