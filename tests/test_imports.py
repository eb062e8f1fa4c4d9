"""Which code may import which: the model knows nothing of how it is trained, the helpers in
utils/ import each other in one direction only, and the page participants read stays a page."""

import ast
import os
import subprocess
import sys

from conftest import ROOT


def imported_modules(path) -> set[str]:
    """Every module a file imports, at the top or inside a function ("from a.b import c" gives
    a.b, and a.b.c too, since c may be a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def module_name(path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_the_model_folder_imports_nothing_but_torch_and_the_standard_library():
    allowed = set(sys.stdlib_module_names) | {"torch", "model"}
    outside = {f"{path.relative_to(ROOT)}: {name}"
               for path in sorted((ROOT / "model").rglob("*.py"))
               for name in imported_modules(path)
               if name.split(".")[0] not in allowed}
    assert not outside, f"model/ holds the network only; these belong elsewhere: {sorted(outside)}"


def import_cycles(edges: dict[str, list[str]]) -> list[str]:
    """Every module from which its imports lead back to it, with the way round."""
    def cycle_from(start, path=()):
        if start in path:
            return [*path[path.index(start):], start]
        for after in edges[start]:
            found = cycle_from(after, (*path, start))
            if found:
                return found
        return None

    return [" -> ".join(c) for name in sorted(edges) if (c := cycle_from(name))]


def test_the_helpers_in_utils_import_each_other_without_a_cycle():
    files = {module_name(p): p for p in (ROOT / "utils").rglob("*.py")}
    edges = {name: sorted(m for m in imported_modules(path) if m in files and m != name)
             for name, path in files.items()}
    cycles = import_cycles(edges)
    assert not cycles, f"import cycles in utils/: {cycles}"


def test_the_cycle_check_sees_imports_inside_functions_and_finds_a_cycle(tmp_path):
    helper = tmp_path / "helper.py"
    helper.write_text("def f():\n    from utils.checks import stop_on_every_rank\n")
    assert "utils.checks" in imported_modules(helper)
    assert import_cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]})[0] == "a -> b -> c -> a"
    assert import_cycles({"a": ["b"], "b": [], "c": ["a", "b"]}) == []


def test_distributed_utils_stays_a_page_a_participant_reads_in_five_minutes():
    lines = len((ROOT / "utils" / "distributed_utils.py").read_text().splitlines())
    assert lines <= 250, (f"utils/distributed_utils.py has {lines} lines: it holds what the "
                          "slides name (setup, print0, save0, the collectives, teardown); "
                          "put the rest in a module of its own (utils/checkpointing.py, "
                          "utils/launch.py)")


def test_every_benchmark_and_tool_starts_from_a_checkout_where_python_has_no_installed_copy(
        tmp_path):
    """A GPU node's own Python has torch but not `pip install -e .`: the first GPU run's
    benchmark stopped at "No module named 'model'"."""
    scripts = sorted((ROOT / "benchmarks").glob("*.py")) + sorted((ROOT / "tools").glob("*.py"))
    code = ("import runpy, sys; sys.meta_path[:] = [f for f in sys.meta_path "
            "if 'editable' not in getattr(f, '__module__', '')]; "
            "sys.argv = [sys.argv[1], '--help']; runpy.run_path(sys.argv[0], run_name='__main__')")
    failed = []
    for script in scripts:
        proc = subprocess.run([sys.executable, "-c", code, str(script)], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300,
                              env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        if "No module named" in proc.stderr:
            failed.append(f"{script.relative_to(ROOT)}: {proc.stderr.strip().splitlines()[-1]}")
    assert not failed, failed
