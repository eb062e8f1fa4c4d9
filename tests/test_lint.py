"""The code participants and instructors read stays clean: ruff's pyflakes (F) and bugbear (B)
rules pass on everything but the exercise files (which keep imports for later TODOs), the
tests included."""

import subprocess
import sys

from conftest import ROOT

CHECKED = ["solutions", "utils", "model", "tools", "benchmarks", "selfcheck", "check.py",
           "prepare_data.py", "tests"]


def test_ruff_finds_nothing_in_the_solutions_helpers_tools_the_check_and_the_tests():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache",
                           "--output-format", "concise", *CHECKED],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
