"""Exercises and solutions come from one source each and never drift apart."""

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
        rel = src.relative_to(exercises.SOURCE_DIR)
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
