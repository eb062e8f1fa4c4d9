"""`python check.py STEP FILE` accepts the solutions and names the TODO of each typical mistake.

Each case copies a solution into a temporary folder, makes one mistake participants make (a
mutation of the solution text) and runs the self-check on the copy, as a participant would.
"""

import re
import subprocess
import sys

import pytest

from conftest import ROOT, script_env

sys.path.insert(0, str(ROOT))
import check  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def reference_cache(tmp_path_factory):
    """The single-process reference runs once per step for the whole module."""
    global REFERENCE_CACHE
    REFERENCE_CACHE = tmp_path_factory.mktemp("check_reference")


def run_check(step, path):
    proc = subprocess.run([sys.executable, "check.py", step, str(path)], cwd=ROOT,
                          env=script_env(CHECK_REFERENCE_CACHE=REFERENCE_CACHE),
                          capture_output=True, text=True, timeout=240)
    flagged = {int(n) for n in re.findall(r"^  (?:FIX|not started) +TODO (\d+)", proc.stdout, re.M)}
    return proc, flagged


def mutated(tmp_path, rel, *replacements):
    text = (ROOT / "solutions" / rel).read_text()
    for old, new in replacements:
        assert old in text, f"the mutation no longer applies to solutions/{rel}: {old!r}"
        text = text.replace(old, new)
    path = tmp_path / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.mark.parametrize("step, rel", [
    ("ddp", "train/to_distributed_training.py"), ("fsdp", "train/fsdp_training.py"),
    ("tp", "train/tp_training.py"), ("pp", "train/pp_training.py"),
    ("sbatch", "to_distributed_training.sbatch"), ("perf", "train/perf_training.py"),
    ("perf-sbatch", "perf_training.sbatch"),
])
def test_the_solution_is_all_good(tmp_path, step, rel):
    proc, flagged = run_check(step, mutated(tmp_path, rel))
    assert proc.returncode == 0 and "all good" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert not flagged


MISTAKES = [
    # (step, file, what goes wrong, TODO it is reported under, words the report uses, mutation)
    ("ddp", "train/to_distributed_training.py", "no set_epoch", 6, "set_epoch",
     [("        train_sampler.set_epoch(epoch)\n", "")]),
    ("ddp", "train/to_distributed_training.py", "no sampler in the DataLoader", 4, "sampler=",
     [("sampler=train_sampler, drop_last=True", "shuffle=True, drop_last=True")]),
    ("ddp", "train/to_distributed_training.py", "no all-reduce in evaluate", 8, "all_reduce_sum",
     [("    loss_sum, tokens = all_reduce_sum(loss_sum), all_reduce_sum(tokens)\n", "")]),
    ("ddp", "train/to_distributed_training.py", "no DDP wrapper", 5, "DDP(",
     [('\n    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)\n',
       "\n")]),
    ("fsdp", "train/fsdp_training.py", "fully_shard on the root only", 18, "every block",
     [("    for block in model.layers.values():\n"
       "        fully_shard(block, reshard_after_forward=reshard_after_forward,\n"
       "                    mp_policy=MixedPrecisionPolicy(**policy))\n", "")]),
    ("fsdp", "train/fsdp_training.py", "no reshard after evaluation", 19, "reshard()",
     [("    model.reshard()\n", "")]),
    ("tp", "train/tp_training.py", "TP samplers count processes", 27, "dp_size",
     [("num_replicas=dp_size, rank=dp_rank", "num_replicas=world_size, rank=rank")]),
    ("sbatch", "to_distributed_training.sbatch", "no is_host", 15, "is_host",
     [("    --rdzv_conf=is_host=$(( SLURM_NODEID == 0 ? 1 : 0 )) \\\n", "")]),
    ("sbatch", "to_distributed_training.sbatch", "MASTER_ADDR from the last node", 13, "sed -n 1p",
     [('| sed -n 1p)', '| tail -n 1)')]),
    ("sbatch", "to_distributed_training.sbatch", "a fixed port", 14, "SLURM_JOB_ID",
     [("$((20000 + SLURM_JOB_ID % 10000))", "29500")]),
    ("perf", "train/perf_training.py", "bf16 without autocast", 45, "autocast",
     [('with annotate("forward", device), autocast(args.precision, device):',
       'with annotate("forward", device):')]),
    ("perf", "train/perf_training.py", "a clock read without synchronize", 42, "synchronize",
     [("                synchronize(device)\n", "")]),
    ("perf", "train/perf_training.py", "no profiler.step", 43, "profiler.step()",
     [("            if profiler is not None:\n                profiler.step()\n", "")]),
    ("perf", "train/perf_training.py", "no range around backward", 44, "backward",
     [('            with annotate("backward", device):\n                loss.backward()',
       "            loss.backward()")]),
    ("perf", "train/perf_training.py", "AdamW not fused", 46, "fused=",
     [(',\n                                  fused=device.type == "cuda")', ")")]),
    ("perf-sbatch", "perf_training.sbatch", "nsys on every run", 48, "NSYS=1",
     [('if [ "${NSYS:-0}" = 1 ]; then', "if true; then")]),
    ("perf-sbatch", "perf_training.sbatch", "nsys without the NVTX ranges", 48, "nvtx",
     [("${NSYS_TRACE:-cuda,nvtx,nccl}", "${NSYS_TRACE:-cuda}")]),
]


@pytest.mark.parametrize("step, rel, what, todo, words, replacements", MISTAKES,
                         ids=[m[2].replace(" ", "-") for m in MISTAKES])
def test_a_typical_mistake_is_reported_under_its_todo(tmp_path, step, rel, what, todo, words,
                                                      replacements):
    proc, flagged = run_check(step, mutated(tmp_path, rel, *replacements))
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert todo in flagged, proc.stdout
    line = next(l for l in proc.stdout.splitlines() if re.match(rf"^  (FIX|not started) +TODO {todo}\b", l))
    assert words in line, proc.stdout


@pytest.mark.parametrize("step, rel", [("ddp", "train/to_distributed_training.py"),
                                       ("sbatch", "to_distributed_training.sbatch"),
                                       ("perf", "train/perf_training.py"),
                                       ("perf-sbatch", "perf_training.sbatch")])
def test_the_exercise_as_shipped_is_not_started_everywhere(tmp_path, step, rel):
    path = tmp_path / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text((ROOT / rel).read_text())
    proc, flagged = run_check(step, path)
    assert proc.returncode == 1
    assert set(check.TODO_NAMES[step]) == flagged
    assert not re.search(r"^  FIX", proc.stdout, re.M) and "Traceback" not in proc.stdout, \
        proc.stdout


def test_a_todo_is_not_started_until_its_block_changes():
    source = ("a = 1\n# TODO 1: x\n#| exercise\n#| solution\nb = 2\n#| end\n"
              "# TODO 2: y\n#| exercise\nc = 3\n#| solution\nc = 4\n#| end\nd = 5\n")
    shipped = "a = 1\n# TODO 1: x\n# TODO 2: y\nc = 3\nd = 5\n"
    assert check.todo_status(source, shipped) == {1: "not started", 2: "not started"}
    assert check.todo_status(source, shipped.replace("# TODO 1: x\n", "# TODO 1: x\nb = 2\n")) \
        == {1: "edited", 2: "not started"}
    assert check.todo_status(source, shipped.replace("c = 3", "c = 4")) \
        == {1: "not started", 2: "edited"}


def test_without_a_step_the_steps_are_listed():
    proc = subprocess.run([sys.executable, "check.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0
    for step in check.STEPS:
        assert f"python check.py {step}" in proc.stdout


def test_a_missing_file_gets_one_line_saying_what_to_give(tmp_path):
    proc = subprocess.run([sys.executable, "check.py", "ddp", str(tmp_path / "nope.py")], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout.count("\n") == 1 and "does not exist" in proc.stdout


@pytest.mark.parametrize("step", check.STEPS)
def test_every_todo_of_the_exercise_is_not_started_and_of_the_solution_edited(step):
    rel = check.STEPS[step][0]
    source = (ROOT / "course" / rel).read_text()
    numbers = set(check.TODO_NAMES[step])
    assert check.todo_status(source, (ROOT / rel).read_text()) == dict.fromkeys(numbers, "not started")
    assert check.todo_status(source, (ROOT / "solutions" / rel).read_text()) == dict.fromkeys(
        numbers, "edited")


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


@pytest.mark.parametrize("step, done, ok", [("ddp", {1, 2, 3, 4, 5, 6}, {2, 4, 5, 6}),
                                            ("perf", {41, 42}, {41, 42}),
                                            ("perf", {41, 42, 43}, {41, 42, 43})])
def test_halfway_through_the_done_todos_are_ok_and_the_others_not_started(tmp_path, step, done,
                                                                          ok):
    rel = check.STEPS[step][0]
    path = tmp_path / rel
    path.parent.mkdir(parents=True)
    path.write_text(partly_done((ROOT / "course" / rel).read_text(), done))
    proc, flagged = run_check(step, path)
    assert proc.returncode == 1
    assert flagged == set(check.TODO_NAMES[step]) - done, proc.stdout
    assert not re.search(r"^  FIX", proc.stdout, re.M), proc.stdout
    for n in ok:
        assert re.search(rf"^  ok +TODO {n}\b", proc.stdout, re.M), proc.stdout
