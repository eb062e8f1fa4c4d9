"""`python check.py STEP FILE` accepts the solutions and names the TODO of each typical mistake.

Each case copies a solution into a temporary folder, makes one mistake participants make (a
mutation of the solution text, tests/check_mutations.py) and runs the self-check on the copy, as
a participant would. The check runs in this process (its fork server stays warm between cases)
and shares its reference runs between the cases.
"""

import contextlib
import io
import json
import os
import re
import subprocess
import sys

import pytest

from check_mutations import (CORRECT, JOB_FILE_CORRECT, JOB_FILE_MISTAKES, MESSAGES, MISTAKES,
                             ONLY_FIXED)
from conftest import ROOT, script_env

sys.path.insert(0, str(ROOT))
from selfcheck import cli, hints  # noqa: E402
from selfcheck.status import todo_status  # noqa: E402
from selfcheck.steps import ORDER, step as step_module  # noqa: E402

FLAGGED = re.compile(r"^  (FIX|not started) +TODO (\d+)\b", re.M)


@pytest.fixture(scope="module", autouse=True)
def check_cache(tmp_path_factory):
    """The check's own folders (its last runs, hints, reference runs) in a temporary place."""
    base = tmp_path_factory.mktemp("course_check")
    saved = {k: os.environ.get(k) for k in ("COURSE_CHECK_CACHE", "CHECK_REFERENCE_CACHE")}
    os.environ.update(COURSE_CHECK_CACHE=str(base), CHECK_REFERENCE_CACHE=str(base / "reference"))
    yield base
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def run_check(*argv):
    """(exit code, printed text, {flagged TODO: its line}) of `python check.py ARGV`."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main([str(a) for a in argv])
    text = out.getvalue()
    flagged = {int(m.group(2)): line for line in text.splitlines()
               for m in [FLAGGED.match(line)] if m}
    return code, text, flagged


def copy_of(tmp_path, rel, *replacements, source="solutions"):
    text = (ROOT / source / rel).read_text()
    for old, new in replacements:
        assert old in text, f"the mutation no longer applies to {source}/{rel}: {old!r}"
        text = text.replace(old, new)
    path = tmp_path / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_each_steps_cases_go_to_one_test_process_together():
    from conftest import xdist_scope
    for step in ORDER:
        for case in (f"test_the_solution_is_all_good[{step}]",
                     f"test_a_typical_mistake_is_reported_under_its_todo[{step}-7-x]"):
            assert xdist_scope(f"tests/test_check.py::{case}") == f"tests/test_check.py::{step}"
    assert xdist_scope("tests/test_check.py::test_without_a_step_the_steps_are_listed") \
        == "tests/test_check.py"


@pytest.mark.parametrize("step", ORDER)
def test_the_solution_is_all_good(tmp_path, step, check_cache):
    code, text, flagged = run_check(step, copy_of(tmp_path, step_module(step).FILE))
    assert code == 0 and text.rstrip().endswith("all good"), text
    assert not flagged
    assert f"({step_module(step).WHAT}) ..." in text.splitlines()[0], text  # (DONE, not TODO)
    lines = [l for l in text.splitlines() if re.match(r"^  ok +TODO \d+", l)]
    assert len(lines) == len(step_module(step).TODOS), "one ok line per TODO\n" + text
    # and no rank imported a torch module its fork server had not imported, or walked torch's
    # objects in its garbage collections (each would cost every rank of every check its time:
    # selfcheck/preload.py)
    dumps = list((check_cache / "last" / step).glob("*/dump/rank*.json"))
    assert dumps or not getattr(step_module(step), "NEEDS_TORCH", True), "no rank's record"
    for dump in dumps:
        record = json.loads(dump.read_text())
        imported = record.get("torch_imported_after_fork")
        assert imported == [], f"{dump}: {imported}"
        assert record.get("gc_frozen_objects", 0) > 0, f"{dump}: the fork server froze nothing"


@pytest.mark.parametrize("step, rel, what, todo, replacements", MISTAKES,
                         ids=[f"{m[0]}-{m[3]}-{m[2].replace(' ', '-')}" for m in MISTAKES])
def test_a_typical_mistake_is_reported_under_its_todo(tmp_path, step, rel, what, todo,
                                                      replacements):
    code, text, flagged = run_check(step, copy_of(tmp_path, rel, *replacements))
    assert code == 1, text
    assert todo in flagged, f"{what}: TODO {todo} is not flagged\n{text}"
    assert "Traceback" not in text and "could not finish" not in text, text
    line = flagged[todo]
    if line.lstrip().startswith("FIX"):  # a FIX says what to change, not only what is wrong
        assert len(line.split(": ", 1)[-1]) > 30, line
    for words in MESSAGES.get(what, ()):
        assert words in line, f"{what}: the line does not say {words!r}\n{line}"
    if what in ONLY_FIXED:  # a consequence is no mistake of another TODO
        fixed = {n for n, l in flagged.items() if l.lstrip().startswith("FIX")}
        assert fixed <= ONLY_FIXED[what], f"{what}: FIX lines for TODOs {fixed}\n{text}"


@pytest.mark.parametrize("step, rel, what, replacements", CORRECT,
                         ids=[f"{c[0]}-{c[2].replace(' ', '-')}" for c in CORRECT])
def test_a_right_solution_written_another_way_is_all_good(tmp_path, step, rel, what,
                                                           replacements):
    code, text, flagged = run_check(step, copy_of(tmp_path, rel, *replacements))
    assert code == 0 and not flagged, f"{what}\n{text}"


def copy_for_job_file(tmp_path, step, job_file, replacements):
    """The job file (mutated) in tmp_path, and what to check: the job file itself (sbatch), or
    the step's solution next to it (collectives: check.py reads the job file of its folder)."""
    job = copy_of(tmp_path, job_file, *replacements, source=".")
    return job if step == "sbatch" else copy_of(tmp_path, step_module(step).FILE)


@pytest.mark.parametrize("step, job_file, what, replacements", JOB_FILE_MISTAKES,
                         ids=[f"{m[0]}-{m[1]}-{m[2].replace(' ', '-')}" for m in JOB_FILE_MISTAKES])
def test_a_job_file_without_todos_gets_a_fix_line_of_its_own(tmp_path, step, job_file, what,
                                                               replacements):
    code, text, _ = run_check(step, copy_for_job_file(tmp_path, step, job_file, replacements))
    assert code == 1, text
    line = re.search(rf"^  FIX +{re.escape(job_file)}: (.*)$", text, re.M)
    assert line and len(line.group(1)) > 30, f"{what}\n{text}"
    for words in MESSAGES.get(what, ()):
        assert words in line.group(1), f"{what}: the line does not say {words!r}\n{line.group(1)}"
    assert "Traceback" not in text and "could not finish" not in text, text


@pytest.mark.parametrize("step, job_file, what, replacements",
                         [*JOB_FILE_CORRECT, *[("sbatch", f, "as shipped", []) for f in
                                               ("collectives.sbatch", "preflight.sbatch")]],
                         ids=lambda v: v.replace(" ", "-") if isinstance(v, str) else None)
def test_a_job_file_without_todos_that_works_is_all_good(tmp_path, step, job_file, what,
                                                          replacements):
    code, text, _ = run_check(step, copy_for_job_file(tmp_path, step, job_file, replacements))
    assert code == 0 and re.search(rf"^  ok +{re.escape(job_file)}: ", text, re.M), text


def test_the_dry_run_warns_about_a_torchrun_that_gets_no_process_count(tmp_path):
    job = copy_of(tmp_path, "collectives.sbatch", *JOB_FILE_MISTAKES[0][3], source=".")
    code, text, _ = run_check("sbatch", job, "--show")
    assert code == 0 and "-> -1 process(es)" in text, text
    assert re.search(r"^WARNING: torchrun on jrc0001 gets --nproc_per_node=: "
                     r"\$SLURM_GPUS_PER_NODE is not set", text, re.M), text


def test_an_endpoint_without_a_port_is_the_port_todo_alone(tmp_path):
    """The address in --rdzv_endpoint=10.10.0.1 is right: only TODO 14's port is missing."""
    code, text, flagged = run_check("sbatch", copy_of(
        tmp_path, "to_distributed_training.sbatch",
        ('--rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT"', '--rdzv_endpoint="$MASTER_ADDR"')))
    assert code == 1 and set(flagged) == {14}, text


def test_every_todo_has_at_least_two_mistakes_in_this_suite():
    counts = {}
    for _step, _, _, todo, _ in MISTAKES:
        counts[todo] = counts.get(todo, 0) + 1
    todos = {n for step in ORDER for n in step_module(step).TODOS}
    assert {n for n in todos if counts.get(n, 0) < 2} == set()


@pytest.mark.parametrize("step", ORDER)
def test_the_exercise_as_shipped_is_not_started_everywhere(tmp_path, step):
    rel = step_module(step).FILE
    code, text, flagged = run_check(step, copy_of(tmp_path, rel, source="."))
    assert code == 1
    assert set(flagged) == set(step_module(step).TODOS), text
    assert not re.search(r"^  (FIX|not checked)", text, re.M) and "Traceback" not in text, text


def partly_done(source: str, done: set) -> str:
    """The exercise with the TODOs in `done` finished (their blocks' solution parts)."""
    out, state, todo = [], None, None
    for line in source.splitlines(keepends=True):
        marker = line.strip()
        if marker in ("#| exercise", "#| solution", "#| end"):
            state = {"#| exercise": "exercise", "#| solution": "solution", "#| end": None}[marker]
            continue
        if state is None:
            found = re.match(r"\s*#\s*TODO (\d+)\b", line)
            todo = int(found.group(1)) if found else todo
            out.append(line)
        elif (state == "solution") == (todo in done):
            out.append(line)
    return "".join(out)


@pytest.mark.parametrize("step, done", [("ddp", {1, 2, 3, 4, 5, 6}), ("ddp", {1, 2, 3, 4, 5}),
                                        ("fsdp", {17, 18, 19}), ("tp", {23, 24, 25, 26}),
                                        # TODO 33 not started: the run stops in evaluate()
                                        ("tp", set(range(23, 33))),
                                        ("perf", {41, 42}), ("perf", {41, 42, 43}),
                                        ("sbatch", {12, 13, 14}),
                                        # a done TODO whose function a TODO not started calls
                                        ("fsdp", {17, 18}), ("tp", {23, 24}), ("pp", {34, 35}),
                                        ("memory", {55}), ("collectives", {49, 50})])
def test_halfway_through_the_done_todos_are_ok_and_the_others_not_started(tmp_path, step, done):
    rel = step_module(step).FILE
    path = tmp_path / rel
    path.parent.mkdir(parents=True, exist_ok=True)  # (a job file lies in tmp_path itself)
    path.write_text(partly_done((ROOT / "course" / rel).read_text(), done))
    code, text, flagged = run_check(step, path)
    assert code == 1
    assert set(flagged) == set(step_module(step).TODOS) - done, text
    assert not re.search(r"^  FIX", text, re.M), text
    for n in done:  # ok, or (a function a later TODO calls) waiting for that TODO
        assert re.search(rf"^  (ok +TODO {n}\b|not checked +TODO {n} .*once TODO)", text,
                         re.M), text


def test_imports_that_ran_stay_ok_when_a_later_line_crashes(tmp_path):
    # peak_flops returns (peak, source): dividing by the tuple stops the run in TODO 42's code,
    # after TODO 41's imports ran; they are not what to look at
    code, text, flagged = run_check("perf", copy_of(
        tmp_path, step_module("perf").FILE,
        ("    peak, peak_source = peak_flops(device, args.precision)",
         "    peak = peak_flops(device, args.precision)\n    peak_source = 'the data sheet'")))
    assert code == 1 and flagged[42].lstrip().startswith("FIX"), text
    assert re.search(r"^  ok +TODO 41\b", text, re.M), text


def test_a_tp_run_stopped_in_evaluation_still_judges_the_training_before_it(tmp_path):
    """TP: evaluate() without loss_parallel stops the run at the end of the first epoch. The
    training TODOs are judged from what ran before it (ok), TODO 33 is the FIX, and only what
    comes after the evaluation waits for it: summary.json (TODO 31, its losses and tokens said
    so far) and the saves (TODO 32)."""
    mistake = next(m for m in MISTAKES if m[2] == "evaluation without loss_parallel")
    code, text, flagged = run_check("tp", copy_of(tmp_path, mistake[1], *mistake[4]))
    assert code == 1 and set(flagged) == {33} and flagged[33].lstrip().startswith("FIX"), text
    for n in (23, 24, 25, 26, 27, 28, 29, 30):
        assert re.search(rf"^  ok +TODO {n}\b", text, re.M), text
    line = re.search(r"^  not checked +TODO 31\b.*$", text, re.M)
    assert line and "written after the evaluation" in line.group(0), text
    assert "so far: the logged training losses equal the single-process run" in line.group(0)
    line = re.search(r"^  not checked +TODO 32\b.*$", text, re.M)
    assert line and "saved after the evaluation" in line.group(0), text
    assert "fix TODO 33 below first" in line.group(0), text


def test_an_ok_line_claims_only_the_layouts_that_ran(tmp_path):
    """Memory TODOs 55, 57, 58 done, 56 not: the FSDP layouts stop in apply_fsdp, so the ok
    lines of checkpointing and accumulation name the layouts that ran, not every layout."""
    rel = step_module("memory").FILE
    path = tmp_path / rel
    path.parent.mkdir(parents=True)
    path.write_text(partly_done((ROOT / "course" / rel).read_text(), {55, 57, 58}))
    code, text, flagged = run_check("memory", path)
    assert set(flagged) == {56}, text
    for n in (55, 58):
        line = re.search(rf"^  ok +TODO {n}\b.*$", text, re.M)
        assert line and "in the layouts that ran (ddp, zero1)" in line.group(0), text


def test_a_later_todo_not_started_yet_is_named_instead_of_a_crash(tmp_path):
    """Pipeline TODOs 34-36 done: the loop still runs the model itself (TODO 37)."""
    rel = step_module("pp").FILE
    path = tmp_path / rel
    path.parent.mkdir(parents=True)
    path.write_text(partly_done((ROOT / "course" / rel).read_text(), {34, 35, 36}))
    code, text, flagged = run_check("pp", path)
    assert 37 in flagged and "not started" in flagged[37], text
    assert "Connection closed" not in flagged[37], text


def test_a_run_that_needs_a_later_todo_says_done_only_when_the_todo_before_is():
    from selfcheck.report import Report
    report = Report({55: "a", 56: "b"}, {55: "edited", 56: "not started"})
    report.needed(56, "the run needs it: x", after=55)
    report.fail(55, "something to change in TODO 55's lines here")
    lines, _ = report.render()
    assert "now that TODO 55 is changed" in lines[1] and "is done" not in lines[1], lines
    report = Report({55: "a", 56: "b"}, {55: "edited", 56: "not started"})
    report.needed(56, "the run needs it: x", after=55)
    report.ok(55, "fine")
    assert "now that TODO 55 is done" in report.render()[0][1]


@pytest.mark.parametrize("printed, verdict", [(1.0, None), (2.1, "not inside the step"),
                                               (0.5, "count every step's tokens")])
def test_tokens_per_s_two_steps_apart_must_agree_with_the_course_monitors(printed, verdict):
    """The perf check's stand-in GPU run reports every second step. A clock restarted inside
    each step prints about 2 x there, where at --log-every 1 it misses only the wait for a
    batch (the tiny model's milliseconds: CI's load once hid it); one step's tokens, 0.5 x."""
    from types import SimpleNamespace
    from selfcheck.report import Report
    from selfcheck.steps import perf
    steps = (2, 4, 6, 8)
    monitor = [f"step {s}/8 | loss 5.0 | 1,000 tokens/s | MFU 0.5%" for s in steps]
    mine = [f"epoch 0 step {s} loss 5.0000 {1000 * printed:.0f} tokens/s MFU 1.0%" for s in steps]
    run = SimpleNamespace(crashed=False, ranks=[{"monitor_lines": monitor}, {}],
                          outputs=["\n".join(l for pair in zip(mine, monitor) for l in pair)])
    ctx = SimpleNamespace(report=Report(perf.TODOS, {}))
    perf.check_rates_between_reports(ctx, run)
    said = [text for _, text in ctx.report.verdicts[42]]
    if verdict is None:
        assert said == []
    else:
        assert len(said) == 1 and verdict in said[0] and "--log-every 2" in said[0], said


@pytest.mark.parametrize("args, kwargs, passed", [
    ([{"type": "TransformerLM"}, {"str": "bf16"}, True], {}, True),
    ([{"type": "TransformerLM"}], {"precision": {"str": "bf16"}}, True),
    ([{"type": "TransformerLM"}], {"dtype": {"type": "dtype"}}, True),  # a name of their own
    ([{"type": "TransformerLM"}], {"reshard_after_forward": True}, False),
    ([{"type": "TransformerLM"}], {}, False)])
def test_apply_fsdp_hands_on_the_precision_by_position_keyword_or_value(args, kwargs, passed):
    from selfcheck.steps import fsdp
    assert fsdp.passes_precision({"args": args, "kwargs": kwargs}) is passed


def test_a_todo_not_checked_points_to_the_fix_above_or_below_it():
    from selfcheck.report import Report
    report = Report({1: "a", 2: "b", 3: "c"}, {1: "edited", 2: "edited", 3: "edited"})
    report.fail(2, "what to change, said at length enough")
    lines, _ = report.render()
    assert "fix TODO 2 below first" in lines[0] and "fix TODO 2 above first" in lines[2], lines


def test_a_todo_judged_only_in_part_is_not_ok_until_the_rest_can_be_judged():
    """TP's TODO 31: the tokens counted are right, but the losses wait for TODO 27's data."""
    from selfcheck.report import Report
    report = Report({27: "a", 31: "b"}, {27: "edited", 31: "edited"})
    report.fail(27, "the replicas read the same data: what to change")
    report.ok(31, "tokens/s count the batch of each replica")
    report.waits(31, "the logged losses are compared once TODO 27 is fixed")
    lines, problems = report.render()
    assert lines[1].split()[:2] == ["not", "checked"], lines
    assert "compared once TODO 27" in lines[1] and "so far: tokens/s count" in lines[1], lines
    assert problems == 2


def test_a_todo_not_checked_waits_for_the_todo_not_started_that_runs_it():
    from selfcheck.report import Report
    status = {18: "edited", 19: "not started", 20: "edited", 21: "not started"}
    report = Report({18: "a", 19: "b", 20: "c", 21: "d"}, status, callers={18: 19})
    report.needed(21, "the run needs it: x")
    lines, _ = report.render()
    assert "checked once TODO 19 (b) is done" in lines[0], lines
    assert "once TODO 21 is done" in lines[2] and "fix" not in lines[2], lines


def test_a_rank_that_exits_without_a_word_is_told_apart_from_the_one_that_waits(tmp_path):
    """Rank 1 leaves with exit code 1 and no message (on a line no TODO owns) while rank 0 waits
    in TODO 8's all_reduce_sum: the FIX goes to TODO 8 and says both."""
    from types import SimpleNamespace

    from selfcheck.failures import analyse
    from selfcheck.report import Report
    from selfcheck.status import Ownership
    from selfcheck.steps.common import Context, report_crash
    rel = step_module("ddp").FILE
    script = copy_of(tmp_path, rel)
    text = script.read_text()
    lines = text.splitlines()
    call, stop, reduce = (lines.index(code) + 1 for code in (
        "        val_loss = evaluate(model, val_loader, device)",
        "        stop_if_not_finite(val_loss, step, \"validation loss\")",
        "    loss_sum, tokens = all_reduce_sum(loss_sum), all_reduce_sum(tokens)"))

    def frame(line, func, file=str(script)):
        return {"file": file, "line": line, "func": func}
    ranks = [{"error": {"message": "RuntimeError: Connection closed by peer", "exit": False,
                        "frames": [frame(call, "main"), frame(reduce, "evaluate"),
                                   frame(1, "all_reduce_sum", "utils/distributed_utils.py")]}},
             {"error": {"message": "", "exit": True,
                        "frames": [frame(stop, "main"),
                                   frame(1, "stop_if_not_finite", "utils/checks.py")]}}]
    run = SimpleNamespace(ranks=ranks, ended={0: "exit 1", 1: "exit 1"}, script=script,
                          stacks=["", ""], outputs=["", ""], summary=None,
                          geometry=SimpleNamespace(world=2))
    run.failure = analyse(run)
    source = (ROOT / "course" / rel).read_text()
    owner = Ownership(source, text)
    report = Report(step_module("ddp").TODOS, owner.status(), owner.callers())
    ctx = Context("ddp", script, tmp_path, source, text, report, owner)
    assert report_crash(ctx, run) == 8
    line = report.verdicts[8][0][1]
    assert f"rank 1 exited (code 1) without a message at line {stop} (no TODO's code)" in line
    assert f"rank 0 waited for it at line {reduce} in all_reduce_sum" in line, line


def test_a_todo_is_not_started_until_its_block_changes():
    source = ("a = 1\n# TODO 1: x\n#| exercise\n#| solution\nb = 2\n#| end\n"
              "# TODO 2: y\n#| exercise\nc = 3\n#| solution\nc = 4\n#| end\nd = 5\n")
    shipped = "a = 1\n# TODO 1: x\n# TODO 2: y\nc = 3\nd = 5\n"
    assert todo_status(source, shipped) == {1: "not started", 2: "not started"}
    assert todo_status(source, shipped.replace("# TODO 1: x\n", "# TODO 1: x\nb = 2\n")) \
        == {1: "edited", 2: "not started"}
    assert todo_status(source, shipped.replace("c = 3", "c = 4")) \
        == {1: "not started", 2: "edited"}


@pytest.mark.parametrize("step", ORDER)
def test_every_todo_of_the_exercise_is_not_started_and_of_the_solution_edited(step):
    rel = step_module(step).FILE
    source = (ROOT / "course" / rel).read_text()
    numbers = set(step_module(step).TODOS)
    assert todo_status(source, (ROOT / rel).read_text()) == dict.fromkeys(numbers, "not started")
    assert todo_status(source, (ROOT / "solutions" / rel).read_text()) == dict.fromkeys(
        numbers, "edited")


# ------------------------------------------------------------------- the command itself
def check_command(*argv, env=None, python=sys.executable):
    return subprocess.run([python, "check.py", *map(str, argv)], cwd=ROOT,
                          env=env or script_env(COURSE_CHECK_CACHE=os.environ["COURSE_CHECK_CACHE"]),
                          capture_output=True, text=True, timeout=240)


def test_without_a_step_the_steps_are_listed():
    proc = check_command()
    assert proc.returncode == 0
    for step in ORDER:
        assert f"python check.py {step}" in proc.stdout


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_after_a_step_names_its_file_todos_and_options(flag):
    for step in ORDER:
        code, text, _ = run_check(step, flag)
        module = step_module(step)
        assert code == 0 and module.FILE in text, text
        for number, what in module.TODOS.items():
            assert f"{number:>2}  {what}" in text, text
        assert f"--hint {min(module.TODOS)}" in text and ("--show" in text) == hasattr(module,
                                                                                       "show")


def test_a_missing_file_or_a_wrong_step_gets_one_line_saying_what_to_give(tmp_path):
    proc = check_command("ddp", tmp_path / "nope.py")
    assert proc.returncode == 2 and proc.stdout.count("\n") == 1 and "does not exist" in proc.stdout
    proc = check_command("dpp")
    assert proc.returncode == 2 and proc.stdout.count("\n") == 1 and "choose one of" in proc.stdout


@pytest.mark.parametrize("content", ["", "def main(:\n", "import nothing_such_module\n",
                                     "x = 1\n", "\x00\x01binary"])
def test_no_file_makes_the_check_itself_end_in_a_traceback(tmp_path, content):
    path = tmp_path / "train" / "to_distributed_training.py"
    path.parent.mkdir()
    path.write_text(content)
    proc = check_command("ddp", path)
    assert proc.returncode in (1, 3), proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert re.search(r"^  (FIX|not started) +TODO", proc.stdout, re.M) or \
        "could not finish" in proc.stdout


def test_the_full_output_of_a_failed_run_is_kept_where_the_check_says(tmp_path):
    path = copy_of(tmp_path, step_module("ddp").FILE,
                   ("from utils.data import DistributedEvalSampler\n", ""))
    code, text, _ = run_check("ddp", path)
    where = re.search(r"\(full output: (\S+)\)", text)
    assert where and "NameError" in open(where.group(1)).read(), text


def test_hints_get_one_level_more_detailed_each_time_and_are_counted():
    texts = [run_check("ddp", "--hint", 5)[1] for _ in range(3)]
    assert "level 1 of 3" in texts[0] and "level 2 of 3" in texts[1] and "level 3" in texts[2]
    assert "model = DDP(model" not in texts[1]   # the exact line only at the last level
    assert "model = DDP(model" in texts[2]
    assert "TODO 5: 3 levels" in hints.used("ddp")
    code, text, _ = run_check("ddp", "--hint", 99)
    assert code == 2 and "TODOs 1-11" in text


@pytest.mark.parametrize("step", ["collectives", "memory"])
def test_the_second_hint_names_the_api_and_the_place_not_the_solutions_lines(step):
    """Level 2 names what to use and where; only level 3 gives the lines."""
    from selfcheck.steps.common import solution_blocks
    module = step_module(step)
    source = (ROOT / "course" / module.FILE).read_text()

    def squeeze(text):
        return re.sub(r"\s+", "", text)
    for todo, lines in solution_blocks(source):
        hint = squeeze(module.HINTS[todo][1])
        copied = [line.strip() for line in lines if len(squeeze(line)) >= 16
                  and squeeze(line) in hint]
        assert not copied, f"TODO {todo}'s second hint holds its solution's lines: {copied}"


def test_a_python_without_torch_is_told_to_activate_the_environment():
    base = os.path.join(sys.base_prefix, "bin", "python3")
    if not os.path.exists(base) or subprocess.run([base, "-c", "import torch"],
                                                  capture_output=True).returncode == 0:
        pytest.skip("no Python without torch here to try it with")
    proc = check_command("ddp", env=script_env(), python=base)
    assert proc.returncode == 2 and proc.stdout.count("\n") == 1, proc.stdout + proc.stderr
    assert "has no torch" in proc.stdout and "source .venv/bin/activate" in proc.stdout


@pytest.mark.parametrize("step", ORDER)
def test_every_todo_has_a_hint_before_the_solution_lines(step):
    module = step_module(step)
    for todo in module.TODOS:
        assert len(module.HINTS.get(todo, ())) == 2, f"TODO {todo} has no two hint levels"


def test_the_dry_run_shows_what_srun_starts_on_every_node(tmp_path):
    code, text, _ = run_check("sbatch", ROOT / "solutions" / step_module("sbatch").FILE, "--show")
    assert code == 0
    starts = [l for l in text.splitlines() if "torchrun" in l and " task " in l]
    assert len(starts) == 2 and "jrc0001 task 0:" in starts[0], text
    assert "jrc0002 task 1:" in starts[1], text  # (srun's task number, SLURM_PROCID)
    assert "4 process(es)" in starts[0] and "--rdzv_conf=is_host=1" in starts[0], text
    assert "MASTER_ADDR=10.10.0.1" in text and "CUDA_VISIBLE_DEVICES=0,1,2,3" in text, text
    # the job id the check's own lines use (its port, 27421), named in the header; no
    # arguments the job file was not given
    job = step_module("sbatch").JOB_IDS[0]
    assert text.splitlines()[0].startswith(f"sbatch to_distributed_training.sbatch: pretend "
                                           f"job {job} on 2 node(s)"), text
    assert f"--rdzv_id={job}" in starts[0] and "MASTER_PORT=27421" in text, text
    assert "--epochs" not in text, text
    code, text, _ = run_check("sbatch", ROOT / step_module("sbatch").FILE, "--show")
    assert code == 0 and "python -u train/to_distributed_training.py" in text, text


def test_the_dry_run_says_which_arguments_the_check_added():
    """perf-sbatch --show submits with --max-steps 5: the header says the check added it."""
    code, text, _ = run_check("perf-sbatch", ROOT / "solutions" / step_module("perf-sbatch").FILE,
                              "--show")
    first = text.splitlines()[0]
    assert code == 0 and first.startswith("NSYS=1 sbatch perf_training.sbatch --max-steps 5:"), text
    assert "(--max-steps 5: added by the check to keep the run short)" in first, text


@pytest.mark.parametrize("output", [
    "RuntimeError: The server socket has failed to listen on any local network address. "
    "port: 59003, useIpv6: 0, code: -98, name: EADDRINUSE, message: address already in use",
    "error: MASTER_PORT 59003 is taken on vm by another program, so rank 0 cannot listen there: "
    "choose another MASTER_PORT (the sbatch files derive it from the job id)"])
def test_a_run_whose_port_another_program_took_is_started_again(output):
    """The check picks a free port, and another program may take it before rank 0 listens:
    the run is then started again, whether torch or the course's setup said so (CI, 2026-11-28:
    the course's own line was not recognised, and a mistake's check failed on it)."""
    from selfcheck.runs import port_taken
    assert port_taken(output)
    assert not port_taken("error: the loss is not finite at step 3")
