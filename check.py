"""Check your own work on a step of the course, at any moment: which TODOs work, which to fix.

    python check.py                    # list the steps
    python check.py ddp                # train/to_distributed_training.py, TODOs 1-11
    python check.py sbatch             # to_distributed_training.sbatch, TODOs 12-16
    python check.py fsdp | tp | pp     # train/fsdp_training.py, train/tp_training.py, ...
    python check.py perf               # train/perf_training.py, TODOs 41-47
    python check.py perf-sbatch        # perf_training.sbatch, TODO 48
    python check.py ddp path/to/my_copy.py     # another file than the one in train/

It runs YOUR script on a tiny made-up corpus (tiny model, dropout 0, two short epochs): once
with 2 processes on the CPU, next to the single-process reference, and compares what comes
out: losses, evaluation, which samples each rank read, the checkpoints, how the model is split.
(The sbatch files run with stand-ins for scontrol, nslookup, srun, torchrun and nsys; in the
performance step torch.compile is recorded, not run: compiling takes minutes on a CPU.) It prints one
line per TODO; exit code 0 only when everything checked works. It takes a few seconds to half a
minute and writes nothing in the repository.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent

# step name -> (the exercise file, what it teaches); its source is course/<the same path>
STEPS = {
    "ddp": ("train/to_distributed_training.py",
            "DDP: samplers, DDP wrapper, reductions, rank 0 output"),
    "sbatch": ("to_distributed_training.sbatch",
               "the DDP job file: GPUs, master address, port, torchrun"),
    "fsdp": ("train/fsdp_training.py", "FSDP2: fully_shard, sharded checkpoints, full export"),
    "tp": ("train/tp_training.py", "tensor parallelism: apply_tp, 2-D mesh, loss_parallel"),
    "pp": ("train/pp_training.py", "pipeline parallelism: stages, schedules, DCP"),
    "perf": ("train/perf_training.py",
             "one GPU fast: tokens/s and MFU, profiler, bf16, fused AdamW, compile"),
    "perf-sbatch": ("perf_training.sbatch", "the performance job file: Nsight Systems"),
}
TODO_NAMES = {
    "ddp": {1: "imports", 2: "setup", 3: "samplers", 4: "DataLoaders", 5: "DDP",
             6: "set_epoch", 7: "loss over ranks", 8: "evaluation over ranks", 9: "print0",
             10: "save0", 11: "destroy_process_group"},
    "fsdp": {17: "imports", 18: "apply_fsdp", 19: "FSDP instead of DDP, reshard",
             20: "sharded checkpoints", 21: "resume", 22: "save_full_model"},
    "tp": {23: "imports", 24: "apply_tp", 25: "--tp", 26: "mesh", 27: "samplers count replicas",
             28: "apply_tp call", 29: "FSDP on dp", 30: "loss_parallel", 31: "per replica",
             32: "save_full_model", 33: "evaluate"},
    "pp": {34: "split_pipeline_stage", 35: "samplers: one replica", 36: "stage and schedules",
           37: "schedule.step", 38: "loss from the last stage", 39: "DCP save",
           40: "evaluation through the pipeline"},
    "sbatch": {12: "GPUs", 13: "master address", 14: "port", 15: "torchrun per node",
               16: "two nodes"},
    "perf": {41: "imports", 42: "tokens/s and MFU", 43: "profiler", 44: "named ranges",
             45: "precision", 46: "fused AdamW", 47: "compile"},
    "perf-sbatch": {48: "Nsight Systems"},
}
NPROC = 2
BATCH = 4          # per rank (DDP, FSDP); the whole batch for TP and PP (one replica)
SEQ_LEN = 16
EPOCHS = 2
TIMEOUT = 120


# ------------------------------------------------------------------------------ report
class Report:
    """Lines per TODO, printed in TODO order; a TODO still as shipped says "not started"."""

    def __init__(self, names: dict, status: dict):
        self.names, self.status, self.entries = names, status, []

    def label(self, todo):
        return f"TODO {todo} ({self.names[todo]})" if todo in self.names else str(todo)

    def ok(self, todo, text):
        self.entries.append((todo, "ok", text))

    def fail(self, todo, text):
        self.entries.append((todo, "FIX", text))

    def info(self, text, todo="run"):
        self.entries.append((todo, "", text))

    def render(self) -> tuple[list[str], int]:
        lines, problems = [], 0
        keys = [k for k in dict.fromkeys(t for t, _, _ in self.entries) if not isinstance(k, int)]
        numbers = sorted(set(self.names) | {t for t, _, _ in self.entries if isinstance(t, int)})
        for key in keys + numbers:
            mine = [(kind, text) for t, kind, text in self.entries if t == key]
            if self.status.get(key) == "not started":
                problems += 1
                hint = next((text for kind, text in mine if kind == "FIX"), "")
                lines.append(f"  not started  {self.label(key)}" + (f" ({hint})" if hint else ""))
                continue
            for kind, text in mine:
                problems += kind == "FIX"
                lines.append(f"  {kind:<12} {self.label(key)}: {text}" if kind else f"  {'':<12} {text}")
        return lines, problems


# ------------------------------------------------------------------- TODO blocks as typed
def parse_blocks(source: str):
    """The exercise text split into (kind, payload): ("text", line) or ("block", (n, lines))."""
    items, state, todo, ex = [], None, None, []
    for line in source.splitlines(keepends=True):
        m = line.strip()
        if m == "#| exercise":
            state, ex = "exercise", []
            continue
        if m == "#| solution":
            state = "solution"
            continue
        if m == "#| end":
            items.append(("block", (todo, ex)))
            state = None
            continue
        if state is None:
            found = re.match(r"\s*#\s*TODO (\d+)\b", line)  # a TODO comment, not a mention
            if found:
                todo = int(found.group(1))
            items.append(("text", line))
        elif state == "exercise":
            ex.append(line)
    return items


def todo_status(source: str, text: str) -> dict[int, str]:
    """For every TODO number: "not started" (all its blocks as shipped) or "edited"."""
    items = parse_blocks(source)
    shipped, owner = [], []   # exercise lines, and the TODO of each line (None: context)
    gaps = {}                 # position in `shipped` of an empty block -> TODO
    for kind, payload in items:
        if kind == "text":
            shipped.append(payload)
            owner.append(None)
        else:
            n, lines = payload
            if not lines:
                gaps.setdefault(len(shipped), []).append(n)
            shipped += lines
            owner += [n] * len(lines)
    status = {n: "not started" for kind, p in items if kind == "block" for n in [p[0]]}
    mine = text.splitlines(keepends=True)
    matcher = difflib.SequenceMatcher(None, shipped, mine, autojunk=False)
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        if op == "equal":
            continue
        touched = {owner[i] for i in range(i1, i2) if owner[i] is not None}
        if op == "insert":  # lines added right before or after a block's own lines edit it
            touched |= {owner[i] for i in (i1 - 1, i1) if 0 <= i < len(owner)} - {None}
        for pos in range(i1, i2 + 1):
            touched |= set(gaps.get(pos, []))
        for n in touched:
            status[n] = "edited"
    return status


# ------------------------------------------------------------------ tiny data, reference runs
def write_tiny_text(folder: Path) -> Path:
    """A made-up corpus with a skewed word distribution: 40 training windows of SEQ_LEN."""
    import random
    rng = random.Random(1234)
    words = [f"w{i}" for i in range(40)]
    weights = [1.0 / (i + 1) for i in range(40)]
    folder.mkdir(parents=True, exist_ok=True)
    for split, n_tokens in (("train", 40 * SEQ_LEN + 1), ("valid", 11 * SEQ_LEN + 1),
                            ("test", 7 * SEQ_LEN + 1)):
        lines, count = [], 0
        while count < n_tokens:
            k = rng.randint(4, 12)
            lines.append(" ".join(rng.choices(words, weights, k=k)))
            count += k + 1
        (folder / f"{split}.txt").write_text("\n".join(lines) + "\n")
    return folder


def run_args(data_dir, cache_dir, out_dir, batch, extra=()):
    return ["--data-dir", str(data_dir), "--cache-dir", str(cache_dir), "--out-dir", str(out_dir),
            "--preset", "tiny", "--seq-len", str(SEQ_LEN), "--dropout", "0", "--epochs",
            str(EPOCHS), "--batch-size", str(batch), "--logger", "none", "--log-every", "1",
            "--num-workers", "0", "--device", "cpu", *extra]


def child_env(dump_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               PYTHONUNBUFFERED="1", CHECK_DUMP_DIR=str(dump_dir),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def start(script: Path, args, work: Path, name: str, nproc: int):
    """Start `script` through the probe (below); returns the process and its open log file."""
    dump = work / name / "dump"
    dump.mkdir(parents=True)
    if nproc == 1:
        cmd = [sys.executable, str(ROOT / "check.py"), "--probe", str(script), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", str(ROOT / "check.py"), "--probe", str(script), *args]
    log = open(work / name / "output.txt", "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(dump), stdout=log,
                            stderr=subprocess.STDOUT, text=True)
    return proc, log


class Run:
    """One run of a script through the probe. With CHECK_REFERENCE_CACHE=DIR (the tests set it),
    a reference run is kept in DIR and reused while the reference script stays the same."""

    def __init__(self, work: Path, name: str, script: Path, batch: int, nproc: int, extra=()):
        self.dir = work / name
        self.out = self.dir / "out"
        self.nproc, self.proc, self.store = nproc, None, None
        cache = os.environ.get("CHECK_REFERENCE_CACHE")
        if cache and name == "reference":
            key = hashlib.sha1(repr((Path(script).read_text(), batch, nproc, list(extra)))
                               .encode()).hexdigest()[:16]
            self.store = Path(cache) / key
            if (self.store / "done").is_file():
                self.dir, self.out = self.store, self.store / "out"
                return
        self.proc, self.log = start(script, run_args(work / "data", self.dir / "cache", self.out,
                                                     batch, extra), work, name, nproc)

    def wait(self):
        if self.proc is None:  # reused from the cache
            self.rc = 0
        else:
            try:
                self.rc = self.proc.wait(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                self.rc = "timeout"
            self.log.close()
        self.output = (self.dir / "output.txt").read_text(errors="replace")
        self.ranks = []
        for r in range(self.nproc):
            f = self.dir / "dump" / f"rank{r}.json"
            self.ranks.append(json.loads(f.read_text()) if f.is_file() else None)
        f = self.out / "summary.json"
        self.summary = json.loads(f.read_text()) if f.is_file() else None
        if self.store and self.proc is not None and not self.crashed:
            partial = self.store.with_name(self.store.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            shutil.copytree(self.dir, partial)
            (partial / "done").write_text("")
            shutil.rmtree(self.store, ignore_errors=True)
            os.replace(partial, self.store)
        return self

    @property
    def crashed(self):
        return self.rc != 0 or self.summary is None or any(r is None for r in self.ranks)

    def error_line(self):
        """The most telling line of a crash."""
        for r in self.ranks:
            if r and r.get("error") and not r["error"].isdigit():  # not a bare exit code
                return r["error"]
        if self.rc == "timeout":
            return f"no end after {TIMEOUT} s (a rank waits for a collective the other never calls?)"
        lines = [l for l in self.output.splitlines() if re.match(r"^\w*(Error|Exception)\b", l)
                 or l.startswith("error:") or ": error: " in l]  # the last: argparse's
        return lines[-1] if lines else (self.output.strip().splitlines() or ["no output"])[-1]


def near(a, b, rel=1e-4, abs_=1e-5):
    return a is not None and b is not None and abs(a - b) <= abs_ + rel * abs(b)


def lists_close(a, b, rel=1e-4):
    return a is not None and b is not None and len(a) == len(b) and all(
        near(x, y, rel) for x, y in zip(a, b))


def plain_model(summary):
    from model import TransformerLM
    from model.transformer import ModelConfig
    return TransformerLM(ModelConfig(**summary["model_config"]))


def load_weights(path: Path, summary):
    """The state dict in a .pt file or a DCP folder, read as a plain model's (or an error)."""
    import torch
    model = plain_model(summary)
    if path.is_dir():
        import warnings

        import torch.distributed.checkpoint as dcp
        state = model.state_dict()
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=str(path))
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state)  # strict: raises on any missing or extra key
    return {k: v.float() for k, v in model.state_dict().items()}


def weights_close(a, b, rel=1e-3, abs_=1e-4):
    import torch
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=rel, atol=abs_) for k in a)


# --------------------------------------------------------------------------- the checks
def crash_report(rep: Report, run: Run):
    rep.fail("run", f"your script stopped with: {run.error_line()}")
    m = re.search(r"name '(\w+)' is not defined", run.error_line())
    if m:
        rep.info(f"-> `{m.group(1)}` is used before it exists: look at the TODO that imports or "
                 "defines it, and at the TODOs that use it")
    if "save0 got sharded" in run.error_line():
        rep.info("-> save0 cannot save sharded weights: use save_full_model (or a DCP save)")
    if "Profiler must be initialized" in run.error_line():
        rep.fail(43, "the profiler recorded no step: call profiler.step() after every training "
                     "step (the schedule counts them)")
    if "unrecognized arguments: --profile" in run.error_line():
        rep.fail(43, "parse_args has no --profile yet")
    rep.info(f"(full output: {run.dir / 'output.txt'})")


def epoch_passes(rank_dump, which):
    """Index lists of every pass over dataset `which` (0 train, 1 validation, 2 test)."""
    ds = rank_dump["datasets"]
    return ds[which]["passes"] if which < len(ds) else []


def check_samplers(rep, run, todo_shard, todo_epoch, status, same_data_on_ranks=False,
                   eval_todo=None):
    r0, r1 = run.ranks
    p0, p1 = epoch_passes(r0, 0), epoch_passes(r1, 0)
    n_train = r0["datasets"][0]["len"]
    if not p0 or not p1:
        rep.fail(todo_shard, "no training batch was read")
        return
    a, b = p0[0], p1[0]
    if same_data_on_ranks:
        if a == b:
            rep.ok(todo_shard, "the ranks of one replica read the same batches")
        else:
            rep.fail(todo_shard, same_data_on_ranks)
    else:
        if set(a) & set(b):
            both = "the same samples" if a == b else f"{len(set(a) & set(b))} samples in common"
            rep.fail(todo_shard, f"both ranks train on {both} in epoch 0: give the training "
                                 "DataLoader sampler=train_sampler, a DistributedSampler(train_ds, "
                                 "num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed, "
                                 "drop_last=True)")
        elif len(a) + len(b) < n_train - NPROC * BATCH:
            rep.fail(todo_shard, f"the ranks read {len(a)} + {len(b)} of {n_train} samples per epoch")
        else:
            rep.ok(todo_shard, f"each rank trains on its own half of the data ({len(a)} samples each)")
    if len(p0) >= 2:
        if p0[0] == p0[1]:
            rep.fail(todo_epoch, "every epoch repeats the first epoch's order: call "
                                 "train_sampler.set_epoch(epoch) at the start of each epoch")
        else:
            rep.ok(todo_epoch, "every epoch has a new order")
    if eval_todo:
        n_val = r0["datasets"][1]["len"]
        v0, v1 = epoch_passes(r0, 1), epoch_passes(r1, 1)
        if v0 and v1:
            real = [i for i in v0[0] + v1[0] if i < n_val]
            if same_data_on_ranks:
                good = v0[0] == v1[0] and sorted(i for i in v0[0] if i < n_val) == list(range(n_val))
            else:
                good = sorted(real) == list(range(n_val))
            if good:
                rep.ok(eval_todo, "evaluation reads every validation sample exactly once")
            else:
                rep.fail(eval_todo, "evaluation does not read every validation sample exactly once "
                                    "over the ranks: use DistributedEvalSampler(dataset, "
                                    "num_replicas, rank) from utils.data for validation and test")


def check_output_once(rep, run, todo):
    counts = {p: len(re.findall(rf"^{p}", run.output, re.M)) for p in ("data:", "test loss")}
    if all(c == 1 for c in counts.values()):
        rep.ok(todo, "rank 0 alone prints")
    else:
        rep.fail(todo, f"'test loss' is printed {counts['test loss']} times, 'data:' "
                       f"{counts['data:']} times: print with print0, so only rank 0 prints")


def check_eval_exact(rep, run, todo):
    """The probe evaluated the same model on the whole split in one process: compare."""
    pairs = [(e["value"], e["full"]) for r in run.ranks[:1] for e in r["evals"] if "full" in e]
    if not pairs:
        rep.fail(todo, "evaluate() was not called as expected")
        return
    if all(near(v, f, 1e-6, 1e-7) for v, f in pairs):
        rep.ok(todo, "validation and test losses equal the single-process evaluation exactly")
    else:
        v, f = next(p for p in pairs if not near(p[0], p[1], 1e-6, 1e-7))
        rep.fail(todo, f"evaluate() returned {v:.6f} on rank 0, the whole split gives {f:.6f}: "
                       "add up loss_sum and tokens over the ranks (all_reduce_sum) before dividing")


def check_losses(rep, run, ref, todo, what="the logged training losses"):
    mine, theirs = run.summary["loss_history"], ref.summary["loss_history"]
    if lists_close(mine, theirs):
        rep.ok(todo, f"{what} equal the single-process run ({len(mine)} steps)")
        return True
    if len(mine) != len(theirs):
        rep.fail(todo, f"{len(mine)} training steps, the single-process run takes {len(theirs)}")
    else:
        i = next(i for i, (x, y) in enumerate(zip(mine, theirs)) if not near(x, y))
        rep.fail(todo, f"{what} differ from the single-process run from step {i + 1} on "
                       f"({mine[i]:.5f} vs {theirs[i]:.5f})")
    return False


def check_final_weights(rep, run, ref, todo, name, ref_name="final_model.pt", how=""):
    path = run.out / name
    if not path.exists():
        rep.fail(todo, f"{name} was not written")
        return
    try:
        mine = load_weights(path, run.summary)
    except Exception as e:  # noqa: BLE001 - any failure to load is the participant's news
        first = str(e).strip().splitlines()[0][:200]
        hint = " (keys start with 'module.': save the unwrapped model)" if "module." in str(e) else ""
        rep.fail(todo, f"{name} does not load into a plain TransformerLM: {first}{hint}{how}")
        return
    theirs = load_weights(ref.out / ref_name, ref.summary)
    if weights_close(mine, theirs):
        rep.ok(todo, f"{name} loads into a plain model and holds the single-process weights")
    else:
        rep.fail(todo, f"{name} loads, but its weights differ from the single-process run")


def check_ddp(rep, script, work, status):
    ref = Run(work, "reference", ROOT / "solutions/train/to_distributed_training.py",
              BATCH * NPROC, 1)
    run = Run(work, "yours", script, BATCH, NPROC, extra=["--eval-probe"])
    ref.wait(), run.wait()
    if ref.crashed:
        raise SystemExit(f"the reference run failed: {ref.error_line()}")
    if run.crashed:
        crash_report(rep, run)
        return
    if run.summary["world_size"] != NPROC:
        rep.fail(2, f"world size {run.summary['world_size']} with {NPROC} processes: "
                           "local_rank, rank, device, world_size = setup(args.seed, args.device)")
        return
    rep.ok(2, f"{NPROC} ranks joined one process group")
    shard_todo = 4 if status.get(3) == "edited" else 3
    check_samplers(rep, run, shard_todo, 6, status, eval_todo=3)
    r0, r1 = run.ranks
    if r0["param_sum"] == r1["param_sum"]:
        rep.ok(5, "both ranks end with the same weights")
    else:
        rep.fail(5, "the ranks' weights drifted apart: wrap the model, "
                           "model = DDP(model, device_ids=[local_rank] if device.type == 'cuda' else None)")
    trained_alike = near(r0["param_sum"], ref.ranks[0]["param_sum"], 1e-5)
    if check_losses(rep, run, ref, 7):
        pass
    elif trained_alike:
        rep.info("   (the weights match the single-process run, so training is right; the "
                 "logged loss is rank 0's own: step_loss = all_reduce_mean(loss.detach()))")
    check_eval_exact(rep, run, 8)
    check_output_once(rep, run, 9)
    saves = r1["torch_saves"]
    if saves:
        rep.fail(10, f"rank 1 called torch.save {saves} times: save with save0(model, path)")
    else:
        rep.ok(10, "only rank 0 writes files")
    check_final_weights(rep, run, ref, 10, "final_model.pt")
    if r0["group_alive"]:
        rep.fail(11, "the process group is still there at the end: "
                            "del model, optimizer; then destroy_process_group()")
    else:
        rep.ok(11, "the process group is destroyed at the end")


def check_fsdp(rep, script, work, status):
    ref = Run(work, "reference", ROOT / "solutions/train/fsdp_training.py", BATCH * NPROC, 1)
    run = Run(work, "yours", script, BATCH, NPROC, extra=["--eval-probe"])
    ref.wait(), run.wait()
    if ref.crashed:
        raise SystemExit(f"the reference run failed: {ref.error_line()}")
    if run.crashed:
        crash_report(rep, run)
        return
    r0 = run.ranks[0]
    units = r0["fsdp"]
    if units is None:
        rep.fail(19, "the model is not sharded (no FSDP unit): "
                            "model = apply_fsdp(model, args.precision, "
                            "args.reshard_after_forward == 'true') instead of DDP(...)")
    else:
        blocks, root = units["blocks"], units["root"]
        if all(blocks) and root:
            rep.ok(18, f"every block ({len(blocks)}) and the root are FSDP units")
        elif root and not any(blocks):
            rep.fail(18, "only the root is sharded: call fully_shard(block, ...) on every "
                                "block in model.layers.values() before fully_shard(model, ...)")
        else:
            rep.fail(18, f"FSDP units: blocks {blocks}, root {root}: fully_shard every "
                                "block, then the root")
        if units["all_dtensor"]:
            rep.ok(18, "every parameter is a DTensor sharded over the ranks")
        else:
            rep.fail(18, "some parameters are not DTensors: " + ", ".join(units["plain"][:4]))
        full = ref.summary["model_state_bytes_per_rank"][0]
        mine = run.summary.get("model_state_bytes_per_rank") or [full] * NPROC
        if max(mine) <= 0.6 * full:
            rep.ok(19, "memory per rank (weights+gradients+optimizer): "
                              f"{' '.join(f'{b / 2**20:.2f}' for b in mine)} MiB, "
                              f"{full / 2**20:.2f} MiB in one process")
        else:
            rep.fail(19, f"each rank holds {max(mine) / 2**20:.2f} MiB of model state, "
                                f"as much as one process ({full / 2**20:.2f} MiB)")
        evals = r0["evals"]
        if evals and all(e["resharded"] for e in evals):
            rep.ok(19, "evaluation leaves the weights sharded")
        elif evals:
            rep.fail(19, "after evaluate() the root's full weights stay gathered on every "
                                "rank: call model.reshard() at the end of evaluate()")
    check_losses(rep, run, ref, "training")
    check_eval_exact(rep, run, "evaluation")
    ckpt = run.out / "checkpoints" / "last"
    if (ckpt / ".metadata").is_file():
        rep.ok(20, "checkpoints/last is a Distributed Checkpoint folder")
        resumed = Run(work, "resumed", script, BATCH * NPROC, 1,
                      extra=["--resume", str(ckpt), "--max-steps", str(run.summary["steps"])]).wait()
        if resumed.crashed:
            rep.fail(21, f"--resume {ckpt} in one process stopped with: {resumed.error_line()}")
        elif (resumed.summary["steps"] == run.summary["steps"]
              and near(resumed.summary["test_loss"], run.summary["test_loss"], 1e-6)):
            rep.ok(21, "a single process resumes the 2-rank checkpoint at the same step "
                              "and evaluates to the same test loss")
        else:
            rep.fail(21, f"resumed at step {resumed.summary['steps']} with test loss "
                                f"{resumed.summary['test_loss']:.6f}; the run that saved it: step "
                                f"{run.summary['steps']}, {run.summary['test_loss']:.6f}")
    else:
        rep.fail(20, "no checkpoints/last folder with DCP's .metadata: "
                            "save_sharded_model(model, optimizer, out_dir / 'checkpoints' / name, ...)")
        rep.fail(21, "needs the checkpoints of TODO 20")
    check_final_weights(rep, run, ref, 22, "final_model.pt")


def check_tp(rep, script, work, status):
    short = ["--max-steps", "8"]  # as for PP: fewer steps, less drift from summing in another order
    ref = Run(work, "reference", ROOT / "solutions/train/to_distributed_training.py", BATCH, 1,
              extra=short)
    run = Run(work, "yours", script, BATCH, NPROC, extra=short)
    ref.wait(), run.wait()
    if ref.crashed:
        raise SystemExit(f"the reference run failed: {ref.error_line()}")
    if run.crashed:
        crash_report(rep, run)
        return
    s = run.summary
    if s.get("tensor_parallel_size") == NPROC:
        rep.ok(26, f"mesh dp {s['global_batch_size'] // BATCH} x tp {NPROC}")
    else:
        rep.fail(26, f"summary says tensor_parallel_size {s.get('tensor_parallel_size')}, "
                            f"expected {NPROC} (--tp defaults to LOCAL_WORLD_SIZE)")
    check_samplers(rep, run, 27, "set_epoch", status,
                   same_data_on_ranks="the two ranks of one TP group read different batches: "
                   "the samplers count data-parallel replicas, DistributedSampler(train_ds, "
                   "num_replicas=dp_size, rank=dp_rank, ...) and DistributedEvalSampler(ds, "
                   "dp_size, dp_rank)", eval_todo=27)
    tp = run.ranks[0]["tp"]
    if tp["wrong"]:
        rep.fail(24, "not split as planned: " + "; ".join(tp["wrong"][:4]))
    else:
        rep.ok(24, "q/k/v and in_proj are split column-wise, out_proj row-wise, the "
                          "embedding and output over the vocabulary")
    units = run.ranks[0]["fsdp"]
    if units and all(units["blocks"]) and units["root"]:
        rep.ok(29, "every block and the root are fully_shard-ed on the dp mesh")
    else:
        rep.fail(29, "fully_shard(block, mesh=mesh['dp']) for every block, then "
                            "fully_shard(model, mesh=mesh['dp'])")
    check_losses(rep, run, ref, 31)
    if near(s["val_loss"], ref.summary["val_loss"]) and near(s["test_loss"], ref.summary["test_loss"]):
        rep.ok(33, "validation and test losses equal the single-process run")
    else:
        rep.fail(33, f"validation loss {s['val_loss']:.5f}, single process "
                            f"{ref.summary['val_loss']:.5f}: loss_parallel, full_tensor(), and "
                            "all_reduce_sum over dp_group in evaluate()")
    check_final_weights(rep, run, ref, 32, "final_model.pt")


def check_pp(rep, script, work, status):
    # 8 steps: microbatches add up in another order, and over many steps Adam amplifies that
    short = ["--max-steps", "8"]
    ref = Run(work, "reference", ROOT / "solutions/train/to_distributed_training.py", BATCH, 1,
              extra=short)
    run = Run(work, "yours", script, BATCH, NPROC, extra=["--microbatches", "2", *short])
    ref.wait(), run.wait()
    if ref.crashed:
        raise SystemExit(f"the reference run failed: {ref.error_line()}")
    if run.crashed:
        crash_report(rep, run)
        return
    r0, r1 = run.ranks
    n_layers = run.summary["model_config"]["n_layers"]
    if (r0["layers"], r1["layers"]) == (list(range(n_layers // 2)), list(range(n_layers // 2, n_layers))) \
            and r0["has_embedding"] and not r0["has_output"] and r1["has_output"] \
            and not r1["has_embedding"]:
        rep.ok(34, "rank 0 holds the embeddings and the first half of the blocks, rank 1 the "
                   "rest and the output layer")
    else:
        rep.fail(34, f"rank 0 holds blocks {r0['layers']} (embedding: {r0['has_embedding']}, "
                     f"output: {r0['has_output']}), rank 1 blocks {r1['layers']} (embedding: "
                     f"{r1['has_embedding']}, output: {r1['has_output']}): "
                     "model = split_pipeline_stage(model, stage_index, num_stages, "
                     "args.layers_per_stage)")
    check_samplers(rep, run, 35, "set_epoch", status,
                   same_data_on_ranks="the stages read different batches: one pipeline is one "
                   "replica, DistributedSampler(train_ds, num_replicas=1, rank=0, ...) and "
                   "DistributedEvalSampler(ds, num_replicas=1, rank=0)", eval_todo=35)
    s = run.summary
    if s.get("pipeline_stages") == NPROC and s.get("idle_fraction_per_stage"):
        rep.ok(36, f"{NPROC} stages; measured idle share per stage "
                   f"{' '.join(f'{f:.0%}' for f in s['idle_fraction_per_stage'])}, theory "
                   f"{s['bubble_fraction_theory']:.0%}")
    else:
        rep.fail(36, "no pipeline ran (no idle shares measured): PipelineStage, build_schedule, "
                     "StageBusyTimer (TODO 36), then schedule.step between timer.start_step() and "
                     "idle_history.append(timer.idle_fraction()) (TODO 37)")
    if check_losses(rep, run, ref, 38):
        rep.ok(37, "schedule.step trains like one process")
    else:
        rep.fail(37, "check that the first stage passes x, the last target=y and losses=losses")
    if near(s["val_loss"], ref.summary["val_loss"]) and near(s["test_loss"], ref.summary["test_loss"]):
        rep.ok(40, "validation and test losses equal the single-process run")
    else:
        rep.fail(40, f"validation loss {s['val_loss']:.5f}, single process "
                     f"{ref.summary['val_loss']:.5f}: schedule.eval through the pipeline, pad the "
                     "last batch, broadcast loss_sum from the last stage")
    if (run.out / "final_model" / ".metadata").is_file():
        check_final_weights(rep, run, ref, 39, "final_model")
    else:
        rep.fail(39, "no final_model folder with DCP's .metadata: "
                     "dcp.save(model.state_dict(), checkpoint_id=out_dir / 'final_model')")

PHASES = ("forward", "backward", "optimizer", "communication")
STEP_REPORT = re.compile(r"^epoch \d+ step \d+ loss [\d.]+ (\d+) tokens/s MFU ([\d.]+)%", re.M)


def trace_names(path: Path) -> set:
    return {e.get("name") for e in json.loads(path.read_text()).get("traceEvents", [])}


def check_perf(rep, script, work, status):
    """Four short runs: 2 ranks with --profile (fp32, as the reference), bf16 with --compile,
    and one step with --profile (too short to profile: it must say so, not crash)."""
    profiling = status.get(43) != "not started"  # before TODO 43 there is no --profile
    ref = Run(work, "reference", ROOT / "solutions/train/perf_training.py", BATCH * NPROC, 1)
    run = Run(work, "yours", script, BATCH, NPROC, extra=["--profile"] if profiling else [])
    fast = Run(work, "bf16", script, BATCH * NPROC, 1,
               extra=["--precision", "bf16", "--compile", "--max-steps", "6"])
    short = Run(work, "one step", script, BATCH * NPROC, 1,
                extra=["--profile", "--max-steps", "1"]) if profiling else None
    runs = [r for r in (run, fast, short) if r is not None]
    for r in (ref, *runs):
        r.wait()
    if ref.crashed:
        raise SystemExit(f"the reference run failed: {ref.error_line()}")
    for r in runs:
        if r.crashed:
            crash_report(rep, r)
            return
    rep.ok(41, "everything the step uses is imported")
    if lists_close(run.summary["loss_history"], ref.summary["loss_history"], rel=1e-5):
        rep.info("in fp32 the losses equal the reference run's: measuring changes nothing")
    else:
        rep.fail(45, "with --precision fp32 the losses differ from the reference run: compute in "
                     "bf16 only under autocast(args.precision, device), which does nothing in fp32")

    # TODO 42: the report of each interval, and the peak that MFU divides by
    reports = STEP_REPORT.findall(run.output)
    if "MFU against" not in run.output:
        rep.fail(42, "say what MFU divides by: peak, peak_source = peak_flops(device, "
                     "args.precision), then print0 it")
    elif not reports:
        rep.fail(42, "no step line ends in '<N> tokens/s MFU <x>%': synchronize(device), then "
                     "rate = interval_tokens / (time.perf_counter() - interval_start)")
    elif not all(float(t) > 0 and 0 < float(m) <= 100 for t, m in reports):
        t, m = next((t, m) for t, m in reports if not (float(t) > 0 and 0 < float(m) <= 100))
        rep.fail(42, f"a step reports {t} tokens/s and MFU {m}%: MFU is rate * flops_per_tok / "
                     "(peak * world_size), between 0 and 100 %")
    elif run.ranks[0].get("synchronize", 0) < len(reports):
        rep.fail(42, "synchronize(device) before reading the clock for each report: a GPU runs "
                     "behind Python, and the time would be only how long queuing the work took")
    else:
        rep.ok(42, f"{len(reports)} steps report tokens/s and MFU, against a stated peak")

    # TODO 43: one trace per rank, the steps of the window, the operator table, short runs
    names = set()
    traces = [sorted((run.out / "profile").glob(f"rank{r}.*.pt.trace.json")) for r in range(NPROC)]
    if not profiling:
        rep.fail(43, "add --profile to parse_args, then make_profiler(...), profiler.step() "
                     "after each step and profiler.stop() at the end")
    elif not all(traces):
        missing = [r for r, t in enumerate(traces) if not t]
        rep.fail(43, f"--profile wrote no trace for rank(s) {missing} into OUT_DIR/profile: "
                     "profiler = make_profiler(out_dir, rank, device, steps_available), "
                     "profiler.step() after each step, profiler.stop() at the end")
    else:
        names = trace_names(traces[0][-1])
        steps = sorted(int(n.split("#")[1]) for n in names if n and n.startswith("ProfilerStep#"))
        if steps != [3, 4, 5]:
            rep.fail(43, f"the trace holds steps {steps or 'none'}, the window is 3 to 5: call "
                         "profiler.step() once after every training step")
        elif "Self CPU time total" not in run.output:
            rep.fail(43, "after profiler.stop(), print0(profiler.key_averages().table(sort_by="
                         "sort_by, row_limit=12))")
        else:
            rep.ok(43, "each rank writes a trace of steps 3-5, and the operator table is printed")
    if short is None:
        pass
    elif "too few to profile" in short.output and not (short.out / "profile").exists():
        rep.ok(43, "a one-step run says it is too short to profile, and trains")
    else:
        rep.fail(43, "with --max-steps 1 say 'too few to profile' (profiler_window returns None) "
                     "instead of starting the profiler")

    # TODO 44: the named phases in the trace (a trace needs TODO 43)
    if names or not profiling:
        missing = [p for p in PHASES if p not in names]
        if missing:
            rep.fail(44, f"the trace has no range named {', '.join(missing)}: with "
                         "annotate(name, device): around the forward pass and loss, backward, "
                         "the optimizer step and the all-reduce of the loss")
        else:
            rep.ok(44, f"the trace names the phases ({', '.join(PHASES)})")

    # TODO 45: bf16 is bf16, and trains like fp32 within bf16's noise
    mine, theirs = fast.summary["loss_history"], ref.summary["loss_history"][:6]
    if fast.summary.get("precision") != "bf16":
        rep.fail(45, f"--precision bf16 ran in {fast.summary.get('precision')}: "
                     "args.precision = set_precision(args.precision, device)")
    elif mine == theirs:
        rep.fail(45, "the bf16 run computes exactly as fp32: run the forward pass and the loss "
                     "under autocast(args.precision, device)")
    elif len(mine) != len(theirs) or max(abs(a - b) for a, b in zip(mine, theirs)) > 0.05:
        rep.fail(45, "the bf16 losses stray more than 0.05 from fp32's: keep the weights in fp32 "
                     "(autocast, not model.to(torch.bfloat16))")
    else:
        gap = max(abs(a - b) for a, b in zip(mine, theirs))
        rep.ok(45, f"bf16 runs under autocast and trains like fp32 (losses within {gap:.4f})")

    # TODO 46 and 47: what the probe saw the script ask for
    adamw = fast.ranks[0].get("adamw", [])
    if any("fused" in kwargs for kwargs in adamw):
        rep.ok(46, "AdamW is asked for fused (on a GPU: fused=device.type == 'cuda')")
    else:
        rep.fail(46, "torch.optim.AdamW(..., fused=device.type == 'cuda'): one kernel for all "
                     "parameters on a GPU")
    compiled, unasked = fast.ranks[0].get("compiled", []), run.ranks[0].get("compiled", [])
    if unasked:
        rep.fail(47, f"{', '.join(unasked)} compiled without --compile: only `if args.compile:`")
    elif "Block" in compiled or "TransformerLM" in compiled:
        rep.ok(47, "--compile compiles the Transformer blocks (recorded, not run, here)")
    else:
        rep.fail(47, "--compile compiled nothing: if args.compile: compile_blocks(model), "
                     "before the model is wrapped in DDP")


def check_perf_sbatch(rep, script, work, status):
    """The job file with and without NSYS=1: Nsight Systems wraps the training only when asked."""
    plain, launched = submit(script, work, ("gpu17",), job="4244", args=("--max-steps", "5"))
    if plain.returncode != 0:
        rep.fail("run", f"bash {script} failed: {(plain.stderr.strip().splitlines() or ['?'])[-1]}")
        return
    nsys, nsys_launched = submit(script, work, ("gpu17",), job="4245", args=("--max-steps", "5"),
                                 env_extra={"NSYS": "1"})
    words = nsys_launched.get("nsys.0", [])
    env0 = dict(l.split("=", 1) for l in nsys_launched.get("env.0", []) if "=" in l)
    out_dir = env0.get("OUT_DIR", "OUT_DIR")
    trace = next((a.split("=", 1)[1] if "=" in a else words[i + 1]
                  for i, a in enumerate(words[:-1]) if a.split("=")[0] in ("-t", "--trace")), "")
    output = next((a.split("=", 1)[1] if "=" in a else words[i + 1]
                   for i, a in enumerate(words[:-1]) if a.split("=")[0] in ("-o", "--output")), "")
    if "nsys.0" in launched:
        rep.fail(48, "nsys runs without NSYS=1: fill PROFILER only inside "
                     "if [ \"${NSYS:-0}\" = 1 ]; then ... fi")
    elif nsys.returncode != 0 or not words:
        rep.fail(48, "with NSYS=1 srun does not start nsys: PROFILER=(nsys profile -t "
                     "cuda,nvtx,nccl -o \"$OUT_DIR/nsys\" --force-overwrite=true), then "
                     "srun ... \"${PROFILER[@]}\" python -u \"$SCRIPT\" ...")
    elif words[0] != "profile" or "python" not in words or "--max-steps" not in words:
        rep.fail(48, f"nsys got `{' '.join(words)}`: nsys profile [its options] python -u "
                     "\"$SCRIPT\" \"${ARGS[@]}\"")
    elif not {"cuda", "nvtx"} <= set(trace.split(",")):
        rep.fail(48, f"nsys records {trace or 'its default'}: -t cuda,nvtx,nccl (the kernels, "
                     "the script's ranges and the NCCL calls)")
    elif not output.startswith(out_dir + "/"):
        rep.fail(48, f"the report goes to {output or 'the current folder'}: "
                     "-o \"$OUT_DIR/nsys\", next to the run's other output")
    else:
        rep.ok(48, f"NSYS=1 runs the training under nsys profile -t {trace}, report in OUT_DIR")


def submit(script, work, nodes, dns=(), job="4242", args=("--epochs", "1"), env_extra=None):
    """`bash script args` as Slurm would start it on `nodes`, the Slurm commands stood in for.

    Returns the finished process and what was launched: {"torchrun.<node>": its arguments,
    "python.<node>", "nsys.<node>", "env.<node>": the environment it got}.
    """
    d = Path(tempfile.mkdtemp(dir=work))
    bin_dir, log, venv = d / "bin", d / "log", d / "venv"
    for x in (bin_dir, log, venv / "bin"):
        x.mkdir(parents=True)
    (venv / "bin" / "activate").write_text("")
    for name, body in SLURM_STUBS.items():
        f = bin_dir / name
        f.write_text(f"#!/bin/bash\n{body}\n")
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "MASTER_", "CUDA_VISIBLE", "NPROC_PER_NODE", "SCRIPT",
                                "OUT_DIR", "NSYS"))}
    env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", VENV=str(venv), FAKE_LOG=str(log),
               FAKE_NODES=" ".join(nodes), FAKE_DNS=" ".join(f"{k}={v}" for k, v in dns),
               SLURM_SUBMIT_DIR=str(d), SLURM_JOB_NAME="job", SLURM_JOB_ID=job,
               SLURM_JOB_NODELIST=",".join(nodes), SLURM_JOB_NUM_NODES=str(len(nodes)),
               SLURM_CPUS_PER_TASK="32", OUT_DIR=str(d / "out"), **(env_extra or {}))
    proc = subprocess.run(["bash", str(script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=30)
    launched = {f.name: f.read_text().splitlines() for f in log.iterdir()}
    return proc, launched


def check_sbatch(rep, script, work, status):
    """Run the job file with stand-ins for the Slurm commands, on 1 and on 2 nodes."""
    text = Path(script).read_text()
    directives = [l for l in text.splitlines() if l.startswith("#SBATCH")]
    if "#SBATCH --gres=gpu:4" in directives:
        rep.ok(12, "4 GPUs per node")
    else:
        rep.fail(12, "ask for the 4 GPUs of a node: #SBATCH --gres=gpu:4")
    if "#SBATCH --nodes=2" in directives:
        rep.ok(16, "two nodes")
    else:
        rep.fail(16, "#SBATCH --nodes=2")

    two, launched = submit(script, work, ("jrc0001", "jrc0002"),
                           dns=(("jrc0001i", "10.10.0.1"), ("jrc0002i", "10.10.0.2")))
    if two.returncode != 0:
        rep.fail("run", f"bash {script} failed: {(two.stderr.strip().splitlines() or ['?'])[-1]}")
        return
    runs = sorted(k for k in launched if k.startswith(("torchrun.", "python.")))
    if any(k.startswith("python.") for k in runs):
        rep.fail(15, "srun still starts python, not torchrun")
        env0 = {}
    else:
        args0, args1 = launched.get("torchrun.0", []), launched.get("torchrun.1", [])
        wanted = ["--nnodes=2", "--rdzv_backend=c10d", "--rdzv_id=4242"]
        missing = [w for w in wanted if w not in args0]
        if not args1:
            rep.fail(15, "torchrun runs on one node only: srun ... bash -c 'exec torchrun ...'")
        elif missing:
            rep.fail(15, f"torchrun lacks {' '.join(missing)}")
        elif not any(a.startswith("--nproc_per_node=") for a in args0):
            rep.fail(15, "torchrun lacks --nproc_per_node=\"$NPROC_PER_NODE\"")
        elif "--rdzv_conf=is_host=1" not in args0 or "--rdzv_conf=is_host=0" not in args1:
            rep.fail(15, "only node 0 hosts the rendezvous: "
                                "--rdzv_conf=is_host=$(( SLURM_NODEID == 0 ? 1 : 0 ))")
        elif "train/to_distributed_training.py" not in " ".join(args0) or args0[-2:] != ["--epochs", "1"]:
            rep.fail(15, "torchrun does not get \"$SCRIPT\" \"${ARGS[@]}\" at the end")
        else:
            rep.ok(15, "one torchrun per node, c10d rendezvous hosted on node 0")
        env0 = dict(l.split("=", 1) for l in launched.get("env.0", []) if "=" in l)
        endpoint = next((a.split("=", 1)[1] for a in args0 if a.startswith("--rdzv_endpoint=")), "")
        if endpoint.startswith("10.10.0.1:"):
            rep.ok(13, "the rendezvous is the InfiniBand address of the first node")
        else:
            rep.fail(13, f"rendezvous endpoint {endpoint or '(none)'}, expected the address "
                                "of jrc0001i: MASTER_ADDR=$(scontrol show hostnames "
                                "\"$SLURM_JOB_NODELIST\" | sed -n 1p), then nslookup \"${MASTER_ADDR}i\"")
        one, one_launched = submit(script, work, ("gpu17",), job="4243")
        one_args = one_launched.get("torchrun.0", [])
        if one.returncode == 0 and any(a.startswith("--rdzv_endpoint=gpu17:") for a in one_args):
            rep.ok(13, "without an InfiniBand name the plain host name is used")
        else:
            rep.fail(13, "on a node without an <node>i name, keep the plain host name: "
                                "if [ -n \"$IB_ADDR\" ]; then MASTER_ADDR=$IB_ADDR; fi "
                                f"({(one.stderr.strip().splitlines() or [''])[-1]})")
        port = endpoint.rsplit(":", 1)[-1] if ":" in endpoint else ""
        port1 = next((a.rsplit(":", 1)[-1] for a in one_args if a.startswith("--rdzv_endpoint=")), "")
        if port.isdigit() and port1.isdigit() and port != port1 and 1024 <= int(port) < 65536:
            rep.ok(14, f"the port ({port}) comes from the job id")
        else:
            rep.fail(14, f"port {port or '(none)'} for job 4242 and {port1 or '(none)'} for job "
                                "4243: export MASTER_PORT=$((20000 + SLURM_JOB_ID % 10000))")
    visible = env0.get("CUDA_VISIBLE_DEVICES") if env0 else None
    if env0 and visible == "0,1,2,3":
        rep.ok(12, "CUDA_VISIBLE_DEVICES=0,1,2,3")
    elif env0:
        rep.fail(12, f"CUDA_VISIBLE_DEVICES is {visible!r}: export CUDA_VISIBLE_DEVICES=0,1,2,3")


# Stand-ins for the Slurm and DNS commands (the same as in tests/test_sbatch.py), plus an env dump.
SLURM_STUBS = {
    "scontrol": 'for n in $FAKE_NODES; do echo "$n"; done',
    "nslookup": '''for entry in $FAKE_DNS; do
  if [ "${entry%%=*}" = "$1" ]; then
    printf 'Server:\\t\\t127.0.0.53\\nAddress:\\t127.0.0.53#53\\n\\nName:\\t%s\\nAddress: %s\\n' "$1" "${entry#*=}"
    exit 0
  fi
done
printf "** server can't find %s: NXDOMAIN\\n" "$1"; exit 1''',
    "srun": '''while [ "${1#-}" != "$1" ]; do shift; done
i=0; for n in $FAKE_NODES; do SLURM_NODEID=$i "$@"; i=$((i + 1)); done''',
    "torchrun": 'printf "%s\\n" "$@" > "$FAKE_LOG/torchrun.$SLURM_NODEID"; env > "$FAKE_LOG/env.$SLURM_NODEID"',
    "python": 'printf "%s\\n" "$@" > "$FAKE_LOG/python.$SLURM_NODEID"; env > "$FAKE_LOG/env.$SLURM_NODEID"',
    "nsys": 'printf "%s\\n" "$@" > "$FAKE_LOG/nsys.$SLURM_NODEID"; env > "$FAKE_LOG/env.$SLURM_NODEID"',
}


# --------------------------------------------------------------------- the probe (in each rank)
def probe(script: str, args: list[str]) -> None:
    """Run the participant's main() in this process and record what the checks need."""
    import importlib.util
    import traceback

    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    import model.transformer as mt
    import utils.data as ud

    eval_probe = "--eval-probe" in args
    args = [a for a in args if a != "--eval-probe"]
    rank = int(os.environ.get("RANK", 0))
    record = {"datasets": [], "evals": [], "torch_saves": 0, "error": None}
    datasets, models = [], []

    init, getitem = ud.TokenWindows.__init__, ud.TokenWindows.__getitem__

    def init_(self, *a, **k):
        init(self, *a, **k)
        self._check = {"len": len(self), "passes": []}
        datasets.append(self)

    def getitem_(self, i):
        if hasattr(self, "_check") and self._check["passes"] and not self._check.get("off"):
            self._check["passes"][-1].append(int(i))
        return getitem(self, i)

    ud.TokenWindows.__init__, ud.TokenWindows.__getitem__ = init_, getitem_
    loader_iter = DataLoader.__iter__

    def iter_(self):
        if hasattr(self.dataset, "_check"):
            self.dataset._check["passes"].append([])
        return loader_iter(self)

    DataLoader.__iter__ = iter_
    model_init = mt.TransformerLM.__init__

    def model_init_(self, *a, **k):
        model_init(self, *a, **k)
        models.append(self)

    mt.TransformerLM.__init__ = model_init_
    save = torch.save

    def save_(obj, *a, **k):
        if isinstance(obj, dict) and any("weight" in str(key) for key in obj):  # a model's weights
            record["torch_saves"] += 1
        return save(obj, *a, **k)

    torch.save = save_
    record["adamw"], record["compiled"] = [], []
    adamw_init = torch.optim.AdamW.__init__

    def adamw_init_(self, *a, **k):
        record["adamw"].append(sorted(k))
        adamw_init(self, *a, **k)

    torch.optim.AdamW.__init__ = adamw_init_

    def compile_(model=None, *a, **k):  # recorded, not run: compiling takes minutes on a CPU
        if model is None:  # @torch.compile(...) as a decorator
            return lambda fn: fn
        record["compiled"].append(type(model).__name__)
        return model

    torch.compile = compile_
    import utils.metrics as um
    record["synchronize"], sync = 0, um.synchronize

    def synchronize_(device):  # counts the calls made by the script itself, not by the helpers
        if sys._getframe(1).f_code.co_filename == os.path.abspath(script):
            record["synchronize"] += 1
        return sync(device)

    um.synchronize = synchronize_
    torch.nn.Module.compile = lambda self, *a, **k: record["compiled"].append(type(self).__name__)

    def all_dtensor(model):
        from torch.distributed.tensor import DTensor
        return all(isinstance(p, DTensor) for p in model.parameters())

    @torch.no_grad()
    def full_eval(model, dataset, device):
        """The whole split in this process (a collective under FSDP: every rank runs it)."""
        import torch.nn.functional as F
        total = torch.zeros((), dtype=torch.float64)
        count = 0
        was = model.training
        model.eval()
        dataset._check["off"] = True
        for i in range(0, len(dataset), 8):
            xs, ys = zip(*(dataset[j] for j in range(i, min(i + 8, len(dataset)))))
            x, y = torch.stack(xs).to(device), torch.stack(ys).to(device)
            logits = model(x)
            total += F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum",
                                     ignore_index=ud.IGNORE_INDEX).double().cpu()
            count += (y != ud.IGNORE_INDEX).sum().item()
        model.train(was)
        dataset._check["off"] = False
        if hasattr(model, "reshard"):
            model.reshard()
        return (total / count).item()

    spec = importlib.util.spec_from_file_location("participant_script", script)
    module = importlib.util.module_from_spec(spec)
    sys.argv = [script, *args]
    try:
        spec.loader.exec_module(module)
        if eval_probe and hasattr(module, "evaluate"):
            original = module.evaluate

            def evaluate(model, loader, device, *rest, **kw):
                value = original(model, loader, device, *rest, **kw)
                entry = {"value": value, "resharded": all_dtensor(model)}
                entry["full"] = full_eval(model, loader.dataset, device)
                record["evals"].append(entry)
                return value

            module.evaluate = evaluate
        module.main()
    except SystemExit as e:
        if e.code not in (0, None):
            record["error"] = str(e.code)
    except BaseException as e:  # noqa: BLE001 - reported to the participant
        record["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        traceback.print_exc()
    record["group_alive"] = dist.is_initialized()
    record["datasets"] = [d._check for d in datasets]
    if models:
        m = models[0]
        record["param_sum"] = float(sum(p.detach().double().sum() if not hasattr(p, "to_local")
                                        else p.to_local().detach().double().sum()
                                        for p in m.parameters()))
        record["fsdp"] = describe_fsdp(m)
        record["tp"] = describe_tp(m)
        record["layers"] = sorted(int(k) for k in m.layers)
        record["has_embedding"] = m.tok_emb is not None
        record["has_output"] = m.output is not None
    dump = Path(os.environ["CHECK_DUMP_DIR"]) / f"rank{rank}.json"
    dump.write_text(json.dumps(record))
    if record["error"]:
        sys.exit(1)


def describe_fsdp(m):
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    if not isinstance(m, FSDPModule) and not any(isinstance(b, FSDPModule) for b in m.layers.values()):
        return None
    plain = [n for n, p in m.named_parameters() if not isinstance(p, DTensor)]
    return {"blocks": [isinstance(b, FSDPModule) for b in m.layers.values()],
            "root": isinstance(m, FSDPModule), "all_dtensor": not plain, "plain": plain}


def describe_tp(m):
    """Which planned TP split every parameter has ("wrong" lists the deviations)."""
    from torch.distributed.tensor import DTensor, Shard
    plan = {"attn.q_proj.weight": 0, "attn.k_proj.weight": 0, "attn.v_proj.weight": 0,
            "attn.out_proj.weight": 1, "mlp.in_proj.weight": 0, "mlp.out_proj.weight": 1}
    wrong = []
    for name, p in m.named_parameters():
        key = name.split(".", 2)[-1] if name.startswith("layers.") else name
        dim = plan.get(key, {"tok_emb.weight": 0, "output.weight": 0}.get(name))
        if dim is None:
            continue
        names = (p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else ()
        if "tp" not in names:
            wrong.append(f"{name} is not split over the tp mesh")
            continue
        placement = p.placements[names.index("tp")]
        if placement != Shard(dim):
            wrong.append(f"{name} is {placement}, expected Shard({dim})")
    return {"wrong": wrong}


# ----------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--probe"]:
        probe(argv[1], argv[2:])
        return 0
    if not argv or argv[0] not in STEPS:
        print(__doc__.split("\n\n")[0])
        print("\nSteps:")
        for name, (path, what) in STEPS.items():
            print(f"  python check.py {name:<11} {path:<33} {what}")
        print("\nAfter the step, another file (or folder holding a copy of the repository) to check:"
              "\n  python check.py ddp my_copy.py")
        return 0 if not argv else 2
    step = argv[0]
    target = Path(argv[1]) if len(argv) > 1 else ROOT / STEPS[step][0]
    if target.is_dir():
        target = target / STEPS[step][0]
    target = target.resolve()
    if not target.is_file():
        print(f"error: {target} does not exist: give the file to check, e.g. "
              f"python check.py {step} {STEPS[step][0]}")
        return 2
    source = ROOT / "course" / STEPS[step][0]
    status = todo_status(source.read_text(), target.read_text())
    rep = Report(TODO_NAMES.get(step, {}), status)
    print(f"Checking {target} ({STEPS[step][1]}) ...", flush=True)
    with tempfile.TemporaryDirectory(prefix="check-") as tmp:
        work = Path(tmp)
        write_tiny_text(work / "data")
        CHECKS[step](rep, target, work, status)
    lines, problems = rep.render()
    print("\n".join(lines))
    if problems:
        print(f"{problems} thing(s) to do or fix: the FIX and 'not started' lines above.")
        return 1
    print("all good")
    return 0


CHECKS = {"ddp": check_ddp, "fsdp": check_fsdp, "tp": check_tp, "pp": check_pp,
          "sbatch": check_sbatch, "perf": check_perf, "perf-sbatch": check_perf_sbatch}

if __name__ == "__main__":
    sys.exit(main())
