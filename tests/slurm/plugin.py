"""pytest plugin: one closing line that says how many Slurm tests ran, passed, failed, skipped.

tests/test_slurm_jobs.py registers it itself when its tests run; a conftest may also load it
(`pytest_plugins = [...]`) to get the line even when the Slurm tests are deselected.
"""


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    outcome_of = {}  # nodeid -> worst outcome over setup, call and teardown
    rank = {"passed": 0, "skipped": 1, "failed": 2, "error": 2}
    for key in ("passed", "skipped", "failed", "error"):
        for report in terminalreporter.stats.get(key, []):
            if "slurm" not in getattr(report, "keywords", {}):
                continue
            kind = "failed" if key == "error" else key
            old = outcome_of.get(report.nodeid)
            if old is None or rank[kind] > rank[old]:
                outcome_of[report.nodeid] = kind
    counts = {k: sum(v == k for v in outcome_of.values()) for k in ("passed", "failed", "skipped")}
    ran = counts["passed"] + counts["failed"]
    # Worded so that it cannot be taken for pytest's own closing line.
    terminalreporter.write_line(
        f"Slurm cluster tests: {ran} ran ({counts['passed']} passed, {counts['failed']} failed), "
        f"{counts['skipped']} skipped")
