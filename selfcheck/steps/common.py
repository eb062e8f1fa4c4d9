"""What several steps check the same way: a crash, the imports, the samplers, who prints,
the numbers a run logs, the weights it saves."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from selfcheck.compare import first_difference, load_weights, near, weights_close
from selfcheck.report import Report
from selfcheck.runs import SEQ_LEN
from selfcheck.status import Ownership


@dataclass
class Context:
    """Everything a step's check needs: the file, its TODOs, where to work, the report."""
    step: str
    script: Path
    work: Path
    source: str          # course/<file>: exercise and solution of every TODO block
    text: str            # the participant's file
    report: Report
    owner: Ownership
    root: Path = Path(__file__).resolve().parents[2]
    extra: dict = field(default_factory=dict)

    @property
    def status(self) -> dict:
        return self.report.status

    def todo_of(self, line) -> int | None:
        return self.owner.todo_of_line(line)

    def imports_of(self) -> dict[int, dict[str, str]]:
        """TODO -> {name: "module.attribute"} that its solution imports."""
        found: dict[int, dict[str, str]] = {}
        source = self.source
        for todo, block in solution_blocks(source):
            for name, target in imported_names("".join(block)).items():
                found.setdefault(todo, {})[name] = target
        return found


def solution_blocks(source: str):
    """(TODO, solution lines) of every block of a course source."""
    out, state, todo, sol = [], None, None, []
    from selfcheck.status import TODO_COMMENT
    for line in source.splitlines(keepends=True):
        m = line.strip()
        if m == "#| exercise":
            state = "exercise"
            continue
        if m == "#| solution":
            state, sol = "solution", []
            continue
        if m == "#| end":
            out.append((todo, sol))
            state = None
            continue
        if state is None:
            found = TODO_COMMENT.match(line)
            todo = int(found.group(1)) if found else todo
        elif state == "solution":
            sol.append(line)
    return out


def imported_names(code: str) -> dict[str, str]:
    """{name bound: "module.attribute" or "module"} of the import statements in `code`."""
    import ast
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return {}
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.split(".")[0]] = a.name
    return names


# ------------------------------------------------------------------------------- crashes
def import_todo(ctx: Context, name: str) -> int | None:
    for todo, names in ctx.imports_of().items():
        if name in names or any(t.rsplit(".", 1)[-1] == name for t in names.values()):
            return todo
    return None


KNOWN_CAUSES = [
    # (pattern in the error, what usually causes it)
    (r"device_ids can only be None|only work with single-device/multiple-device GPU modules",
     "on the CPU DDP takes device_ids=None: device_ids=[local_rank] if device.type == 'cuda' "
     "else None"),
    (r"mutually exclusive with shuffle|sampler option is mutually exclusive",
     "a DataLoader with a sampler must not get shuffle=True: the sampler shuffles"),
    # (the backward of a loss over split logits, run after loss_parallel() ended)
    (r"_loss_backward\S* got mixed torch\.Tensor and DTensor",
     "the backward pass ran outside loss_parallel(): it needs the context as the loss does, "
     "so call loss.backward() inside the same with loss_parallel(): block"),
    (r"Operator c10d\.\w+ does not have a sharding strategy",
     "a DTensor went into a torch.distributed collective, which takes plain tensors: "
     ".full_tensor() first (the loss computed under loss_parallel() is a DTensor)"),
    (r"mixed torch\.Tensor and DTensor|\(raised in torch/distributed/tensor/",
     "a plain tensor met a DTensor: the loss over split logits needs loss_parallel(), and a "
     "DTensor result needs .full_tensor() before plain tensor code uses it"),
    (r"Process group DeviceMesh\(|'DeviceMesh' object has no attribute '(bound_device_id|"
     r"group_name|_get_backend_name)'",
     "a device mesh went where a process group goes (all_reduce_sum(t, group), "
     "evaluate(..., dp_group)): a mesh dim's process group is mesh['dp'].get_group(), dp_group"),
    (r"save0 got sharded",
     "no rank holds the whole model any more: save_full_model, called on every rank, gathers "
     "it into one file (or a DCP save writes every rank's shards)"),
    (r"NVTX functions not installed",
     "NVTX needs a GPU (a CUDA build of torch): open torch.cuda.nvtx ranges only when "
     "device.type == 'cuda', record_function on every device"),
    (r"Default process group has not been initialized|process group has not been initialized",
     "a collective before setup(): call setup() first"),
    (r"Invalid rank \d+, rank should be in the interval",
     "a sampler's rank numbers the replica that reads the shard, below its num_replicas: "
     "give both from the same count (num_replicas=dp_size, rank=dp_rank with a dp mesh; "
     "num_replicas=world_size, rank=rank without)"),
    (r"index out of range in self",
     "a number that is no token id went into the embedding: the inputs are token ids, "
     "0 to the vocabulary size - 1 (pad inputs with 0; IGNORE_INDEX is for the targets only)"),
    (r"unrecognized arguments: (true|false|[\d.]+)\b",
     "an option takes no value (action='store_true') where the course gives it one "
     "(--reshard-after-forward false): add_argument(name, choices=['true', 'false'], "
     "default=...), or type=int for a number"),
    (r"unrecognized arguments",
     "the script's parser has no such option yet"),
    (r"Profiler must be initialized", "the profiler recorded no step: call profiler.step() "
     "after every training step"),
    (r"does not support containers that do not implement forward",
     "fully_shard takes a module that computes something: each block of model.layers (for "
     "block in model.layers.values(): fully_shard(block, ...)), not the ModuleDict that holds "
     "them; then the whole model"),
    # (a ModuleDict iterated: its names, not its blocks; the memory and TP steps' loops too)
    (r"'str' object has no attribute '(modules|named_modules|parameters|register_forward\w*|"
     r"_apply|children|named_children)'",
     "model.layers is a ModuleDict: iterating it gives the blocks' names; "
     "for block in model.layers.values() gives the blocks"),
    (r"Object of type (Tensor|DTensor) is not JSON serializable",
     "the train_state is written as JSON: numbers, not tensors (a loss history as floats, "
     "[loss.item() for loss in loss_history]; a tensor's .item())"),
    (r"Cannot access accelerator device when none is available",
     "pinned host memory needs a GPU, and CPUOffloadPolicy() pins by default: "
     "CPUOffloadPolicy(pin_memory=torch.cuda.is_available())"),
    (r"Torch not compiled with CUDA enabled",
     "a torch.cuda call on a CPU (torch.cuda.synchronize()?): synchronize(device) from "
     "utils.metrics waits for a GPU only where there is one: it does nothing on a CPU"),
    # (FSDP looks for the mesh above the one its parameters are on, and finds none)
    (r"Invariant encountered: value was None when it should not be",
     "fully_shard met parameters already split on another mesh: shard every block before the "
     "model (fully_shard(model, ...) last), all with the same mesh (with TP: mesh=mesh['dp'] "
     "in every fully_shard call)"),
    (r"Cannot concatenate overlapping meshes",
     "fully_shard got a mesh that holds the tp dimension as well, where TP has split the "
     "parameters already: shard over the data-parallel dimension only, mesh=mesh['dp'] in "
     "every fully_shard call"),
    (r"has no attribute '_cuda_setDevice'|Found no NVIDIA driver|no CUDA GPUs are available",
     "a CUDA device asked for where there is none: the device type of the run, "
     "init_device_mesh(device.type, ...), and tensors on device, not 'cuda' written in"),
    (r"size mismatch|shape mismatch|mat1 and mat2 shapes cannot be multiplied|must match the "
     r"size of tensor|must have same reduction dim",
     "tensor shapes do not fit: a layer split or kept where it should not be"),
]


def usual_cause(message: str) -> str | None:
    for pattern, cause in KNOWN_CAUSES:
        if re.search(pattern, message):
            return cause
    return None


def crash_todo(ctx: Context, failure) -> int | None:
    """The TODO a crash belongs to: an unknown name's import, else the failing rank's position
    (rank_todo), else another rank's: a rank that waited in a collective, or left without a
    word, tells little by its own line, and in a hang the rank inside a TODO's lines is the one
    that went another way (`if stage.is_last:` around a broadcast)."""
    m = re.search(r"name '(\w+)' is not defined", failure.message)
    if m:
        todo = import_todo(ctx, m.group(1))
        if todo:
            return todo
    m = re.search(r"cannot import name '(\w+)'|No module named '([\w.]+)'", failure.message)
    if m:
        todo = import_todo(ctx, m.group(1) or m.group(2).rsplit(".", 1)[-1])
        if todo:
            return todo
    for f in [failure, *telling_peers(failure)]:
        todo = rank_todo(ctx, f)
        if todo is not None:
            return todo
    return None


def telling_peers(failure) -> list:
    """The other ranks whose position says something about a failure: all of them when it waited
    or left without a word; else those that waited (the rank that went another way stopped on
    its own, the other waits where the two parted)."""
    if failure.waiting or failure.silent:
        return [p for p in failure.peers if p.frames]
    return [p for p in failure.peers if p.frames and p.waiting]


def rank_todo(ctx: Context, f) -> int | None:
    """The TODO of one rank's position: the helper it was in, whose TODO is clear wherever it
    is called (destroy_process_group: the last TODO of the DDP step); in a wait, the collective
    it waited in, which belongs where the solution calls it (all_reduce_mean put into a print
    on rank 0 only: the TODO of the loss, not of the print); else the innermost of its lines
    that a TODO owns."""
    calls_todo = ctx.extra.get("call_todo", {})
    if f.callee in calls_todo:
        return calls_todo[f.callee]
    todo = ctx.owner.callee_todo(f.callee) if f.waiting else None
    if todo is not None:
        return todo
    for frame in reversed(f.frames):
        todo = ctx.todo_of(frame.get("line"))
        if todo is not None:
            return todo
    return None


def flow_todos(ctx: Context, line: int | None) -> dict[int, str]:
    """{TODO: what it made of a name} for a line no TODO owns: the edited TODOs whose lines before
    it, in the same function, bind a name the line uses or hand it to a call of their own
    (`model = apply_tp(model, ...)`, `fully_shard(model)` for `logits = model(x)`), and the TODO
    of a function of the script those lines call (apply_tp's)."""
    import ast
    from collections import Counter
    try:
        tree = ast.parse(ctx.text)
    except SyntaxError:
        return {}
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef,
                                                              ast.AsyncFunctionDef))]
    scopes = [n for n in functions if line and n.lineno <= line <= n.end_lineno]
    scope = min(scopes, key=lambda n: n.end_lineno - n.lineno) if scopes else tree
    defs = {n.name: n for n in functions}

    def edited(n):
        return n if n is not None and ctx.status.get(n) == "edited" else None

    def simple(node):  # a statement without the statements it holds (a for: its header)
        if isinstance(node, (ast.For, ast.AsyncFor)):
            return [node.target, node.iter]
        if isinstance(node, (ast.If, ast.While)):
            return [node.test]
        if isinstance(node, (ast.With, ast.AsyncWith)):
            return node.items
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Try)):
            return []
        return [node]

    def made(node):  # the names a statement binds, or hands to a call it makes for its effect
        names = {n.id for p in simple(node) for n in ast.walk(p)
                 if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            call = node.value
            names |= {a.id for a in [*call.args, *(k.value for k in call.keywords)]
                      if isinstance(a, ast.Name)}
        return names

    def owner_of(function):  # the TODO that wrote most of a function's statements
        counts = Counter(edited(ctx.todo_of(n.lineno)) for n in ast.walk(function)
                         if isinstance(n, ast.stmt) and n is not function)
        counts.pop(None, None)
        return counts.most_common(1)[0][0] if counts else None

    statements = [n for n in ast.walk(scope) if isinstance(n, ast.stmt) and n is not scope]
    at_line = [n for n in statements if line and n.lineno <= line <= n.end_lineno and simple(n)]
    if not at_line:
        return {}
    crashed = min(at_line, key=lambda n: n.end_lineno - n.lineno)
    used = {n.id for p in simple(crashed) for n in ast.walk(p) if isinstance(n, ast.Name)}
    found: dict[int, str] = {}
    for node in sorted(statements, key=lambda n: n.lineno):
        shared = sorted(made(node) & used)
        todo = edited(ctx.todo_of(node.lineno))
        if node.lineno >= line or not shared or todo is None:
            continue
        found.setdefault(todo, f"{shared[0]}, which TODO {todo}'s code changed")
        for call in (c for p in simple(node) for c in ast.walk(p) if isinstance(c, ast.Call)):
            inner = defs.get(getattr(call.func, "id", None))
            owner = owner_of(inner) if inner else None
            if owner is not None:
                found.setdefault(owner, f"{shared[0]} as TODO {owner}'s {inner.name} made it")
    return found


def position(ctx: Context, f) -> str:
    """Where a rank was: "line 259 (no TODO's code) in report"."""
    call = f" in {f.callee}" if f.callee and f.callee not in ("wait", "wrapper") else ""
    mine = "" if ctx.todo_of(f.line) is not None else " (no TODO's code)"
    return f"line {f.line}{mine}{call}" if f.line else "a line outside your script"


def report_crash(ctx: Context, run, todo: int | None = None, cause: str | None = None,
                 default_todo: int | None = None, prefix: str = "") -> int | None:
    """One FIX line for a run that did not finish, under the TODO it belongs to. prefix: which
    run it was ("with --layout zero2, "), for a step that runs several."""
    f = run.failure
    rep = ctx.report
    if f is None:
        return None
    todo = todo or crash_todo(ctx, f) or default_todo
    several = f.rank is not None and run.geometry.world > 1
    who = f"rank {f.rank}" if several else "your script"
    finished = [r for r, e in run.ended.items() if e == "exit 0"]
    elsewhere = [p for p in f.peers if p.waiting and p.line and p.line != f.line]
    hang = "every rank must make the same collective calls in the same order (no `if rank " \
        "== 0:` around a save or an all-reduce)"
    if f.waiting:
        if elsewhere:  # both wait, each in its own collective: the two lines show where they part
            what = (f"{who} waited at {position(ctx, f)} while rank {elsewhere[0].rank} waited "
                    f"at {position(ctx, elsewhere[0])}: they wait in different collectives")
        else:
            other = f"rank {finished[0]}, which had finished," if finished else "another rank"
            what = (f"{who} waited at {position(ctx, f)} for a collective that {other} never "
                    f"joined" if f.line else f"{who} waited for the other ranks and never "
                    f"finished")
        cause = cause or hang
    elif f.silent:
        what = f"{who} {f.message}" + (f" at {position(ctx, f)}" if f.line else "")
        if elsewhere and several:
            what += (f", while rank {elsewhere[0].rank} waited for it at "
                     f"{position(ctx, elsewhere[0])}")
            cause = cause or hang
    else:
        where = f.where().replace(",", ", no TODO's code,", 1) if ctx.todo_of(f.line) is None \
            else f.where()
        what = f"{who} stopped{where} with: {f.message.rstrip('.')}"
        if elsewhere and ctx.todo_of(f.line) is None:  # the other rank's line shows where
            what += f" (rank {elsewhere[0].rank} waited at {position(ctx, elsewhere[0])})"
        cause = cause or usual_cause(f.message)
    if todo is not None and todo in rep.names:
        text = prefix + what + (f": {cause}" if cause else "")
        if ctx.status.get(todo) == "not started" and todo not in rep.attempted:
            done = [n for n, s in ctx.status.items() if s == "edited" and n < todo]
            rep.needed(todo, f"the run needs it: {text}", after=max(done) if done else None)
        else:
            rep.fail(todo, text)
            rep.attempt(todo)
        return todo
    target, note = crash_target(ctx, f)
    rep.fail(target, prefix + what + note + (f": {cause}" if cause else ""))
    rep.attempt(target)
    return todo


def crash_target(ctx: Context, f) -> tuple[int, str]:
    """Where a crash on a line no TODO owns is filed, and what to add to its text: a TODO that
    already has a FIX (the crash follows from it: its line gets the crash too), the first TODO
    not started, the first edited TODO whose code made what the line uses (apply_tp's plan for
    `logits = model(x)`), the nearest edited TODO above the line, else the last TODO."""
    rep = ctx.report
    fixed = [n for n in sorted(rep.names) if any(k == "FIX" for k, _ in rep.verdicts.get(n, []))]
    flow = flow_todos(ctx, f.line)
    if fixed:
        return next((n for n in fixed if n in flow), fixed[0]), ""
    first = next((n for n, s in sorted(ctx.status.items()) if s == "not started"), None)
    if first is not None:
        return first, (f" (TODO {first} is not started yet: the TODOs work in order, finish it "
                       "first)")
    if flow:
        return min(flow), f"; the line uses {flow[min(flow)]}"
    above = [ctx.todo_of(n) for n in range(1, f.line or 0)]
    edited = [n for n in above if n is not None and ctx.status.get(n) == "edited"]
    return (edited[-1] if edited else max(rep.names)), ""


def stopped_early(ctx: Context, *runs) -> bool:
    """Report the first run that crashed; True if one did (the other checks need its files)."""
    for run in runs:
        if run is not None and run.crashed:
            report_crash(ctx, run)
            ctx.report.note(f"(full output of the {run.name} run: {run.dir / 'output.txt'})")
            return True
    return False


# ------------------------------------------------------------------------------- imports
def check_imports(ctx: Context, todo: int, run) -> None:
    """A TODO that imports: ok when the script runs and holds what the solution imports (under
    any name, in any import line); a missing one is named with where it comes from."""
    wanted = ctx.imports_of().get(todo, {})
    record = next((r for r in run.ranks if r), None)
    if not wanted or record is None or "globals" not in record:
        return
    bound = set(record.get("globals", {}).values())
    missing = [t for t in wanted.values() if t not in bound and t.split(".")[-1] not in
               {b.split(".")[-1] for b in bound}]
    if ctx.report.failed(todo):
        return
    rebound = imported_as_other(ctx, todo, run)
    if rebound:
        ctx.report.fail(todo, "; ".join(
            f"{name} is {bound} here, not {short_import(target)}"
            for name, (bound, target) in rebound.items())
            + ": " + "; ".join(f"from {target.rpartition('.')[0]} import "
                               f"{target.rpartition('.')[2]}" for _, target in rebound.values()))
    elif not missing:
        ctx.report.ok(todo, "everything the step uses is imported")
    elif len(missing) == len(wanted):
        ctx.report.fail(todo, "nothing of it is imported yet: " + ", ".join(
            short_import(t) for t in wanted.values()))
    else:
        used = {c["name"] for r in run.ranks if r for c in r.get("calls", [])}
        really = [t for t in missing if t.rsplit(".", 1)[-1] in used]
        if really:
            ctx.report.fail(todo, "import " + ", ".join(short_import(t) for t in really))
        else:  # the script does without them: nothing to fix
            ctx.report.ok(todo, "the names the script uses are imported")


def imported_as_other(ctx: Context, todo: int, run) -> dict[str, tuple[str, str]]:
    """{name: (what it is, what the solution imports under it)} for the names of a TODO's
    imports that the script binds to something else (FSDP1's FullyShardedDataParallel
    imported as FSDPModule): the script runs, but every isinstance and call means another
    thing."""
    record = next((r for r in run.ranks if r), None) if run.ranks else None
    bound = (record or {}).get("globals", {})
    last = {b.rsplit(".", 1)[-1] for b in bound.values()}
    return {name: (bound[name].rsplit(".", 1)[-1], target)
            for name, target in ctx.imports_of().get(todo, {}).items()
            if name in bound and bound[name].rsplit(".", 1)[-1] != target.rsplit(".", 1)[-1]
            and target.rsplit(".", 1)[-1] not in last}


def short_import(target: str) -> str:
    module, _, name = target.rpartition(".")
    return f"{name} from {module}" if module else target


# ------------------------------------------------------------------------------- samplers
def sampler_records(record, kind=None):
    return [s for s in record.get("samplers", []) if kind is None or s["kind"] == kind]


def train_sampler(record):
    """The sampler of the training DataLoader (dataset 0), if any."""
    for loader in record.get("loaders", []):
        if loader["dataset"] == 0 and loader["sampler"] is not None:
            return record["samplers"][loader["sampler"]]
    return None


def epoch_passes(record, which):
    ds = record.get("datasets", [])
    return ds[which]["passes"] if which < len(ds) else []


def check_training_shards(ctx, run, todo_sampler, todo_loader, replicas, replica_of,
                          made_is_attempt=True, given_as="num_replicas=world_size, rank=rank"):
    """Each replica trains on its own shard: `replicas` replicas, rank r in replica_of(r).
    made_is_attempt: building a DistributedSampler at all shows the TODO was started (not in
    the steps whose exercise has samplers already). given_as: the sampler's arguments in the
    step's solution, for the FIX line. Returns whether the shards are right:
    where they are not, a comparison of the training with one process can only differ."""
    rep = ctx.report
    records = run.ranks
    n_train = records[0]["datasets"][0]["len"] if records[0].get("datasets") else 0
    passes = [epoch_passes(r, 0) for r in records]
    if not all(passes):
        if not run.crashed:
            rep.fail(todo_loader, "no training batch was read")
        return False
    firsts = [p[0] for p in passes]
    samplers = [train_sampler(r) for r in records]
    made = [sampler_records(r, "DistributedSampler") for r in records]
    if any(made) and made_is_attempt:
        rep.attempt(todo_sampler)
    if made_is_attempt and any(l["sampler"] is not None for r in records
                               for l in r.get("loaders", [])):
        rep.attempt(todo_loader)
    problems = []
    if run.crashed and not all(firsts):
        return False  # the crash is the news
    for rank, (sampler, record) in enumerate(zip(samplers, records, strict=True)):
        given = (sampler or {}).get("given", {})
        if sampler is None:
            if made[rank]:
                problems.append((todo_loader, "the training DataLoader has no sampler: "
                                 "DataLoader(train_ds, sampler=train_sampler, drop_last=True, ...) "
                                 "and no shuffle=True (the sampler shuffles)"))
            else:
                problems.append((todo_sampler, None))
            break
        want_rank = replica_of(rank)
        got_replicas, got_rank = given.get("num_replicas"), given.get("rank")
        if got_replicas is not None and got_replicas != replicas:
            count = "is one replica" if replicas == 1 else f"are {replicas} replicas"
            problems.append((todo_sampler, f"the training sampler has num_replicas="
                             f"{got_replicas}, but there {count} to split the data over: "
                             f"DistributedSampler(train_ds, {given_as}, ...)"))
            break
        if got_rank is not None and got_rank != want_rank:
            local = record["local_rank"]
            why = (" (that is LOCAL_RANK: on two nodes both first processes would read the "
                   "same data; use the global rank)" if got_rank == local and local != want_rank
                   else "")
            problems.append((todo_sampler, f"rank {rank}'s training sampler has rank={got_rank}, "
                             f"expected {want_rank}{why or f': DistributedSampler(train_ds, {given_as}, ...)'}"))
            break
        if given.get("shuffle") is False:
            problems.append((todo_sampler, "the training sampler has shuffle=False: it must "
                             "shuffle (shuffle=True, seed=args.seed)"))
            break
        # (shuffle is on by default; the check's runs use seed 0, the sampler's default)
        if given.get("shuffle") is not False and "seed" not in given:
            problems.append((todo_sampler, "the training sampler shuffles with its own seed, "
                             "0, whatever --seed says: every run reads the data in one order; "
                             "DistributedSampler(..., shuffle=True, seed=args.seed, ...)"))
            break
    if not problems:
        groups: dict[int, list[list[int]]] = {}
        for rank, first in enumerate(firsts):
            groups.setdefault(replica_of(rank), []).append(first)
        if any(any(g != group[0] for g in group) for group in groups.values()):
            problems.append((todo_sampler, "the ranks of one replica read different batches"))
        else:
            shards = [group[0] for group in groups.values()]
            seen = [i for s in shards for i in s]
            if len(seen) != len(set(seen)):
                common = len(seen) - len(set(seen))
                seeds = [(s or {}).get("given", {}).get("seed") for s in samplers]
                why = (f": their samplers shuffle with seeds {', '.join(map(str, seeds))}, "
                       "and each seed gives another order, so the shards overlap; the same "
                       "seed on every rank, seed=args.seed" if len(set(map(str, seeds))) > 1
                       else "")
                problems.append((todo_sampler if len(shards) > 1 else todo_loader,
                                 f"the replicas train on {common} samples in common in epoch "
                                 f"0{why}"))
            elif len(seen) < n_train - replicas * 8 and not run.crashed:
                problems.append((todo_sampler, f"the replicas read {len(seen)} of {n_train} "
                                 "training samples per epoch"))
    for todo, text in problems[:1]:
        rep.fail(todo, text or "every rank reads the whole training set: train_sampler = "
                 "DistributedSampler(...) (see the TODO), passed to the training DataLoader")
        if todo != todo_loader:
            rep.waits(todo_loader, f"the training DataLoader is checked once TODO "
                      f"{todo_sampler}'s sampler gives each replica its own shard")
    if not problems:
        each = len(firsts[0])
        rep.ok(todo_sampler, f"each of the {replicas} replicas trains on its own shard "
                             f"({each} samples per epoch)" if replicas > 1 else
                             "the ranks of the one replica read the same batches")
        rep.ok(todo_loader, "the training DataLoader takes its batches from the sampler")
    return not problems


def check_new_order(ctx, run, todo_epoch, todo_sampler):
    rep = ctx.report
    record = run.ranks[0]
    passes = epoch_passes(record, 0)
    if len(passes) < 2:
        return
    calls = record.get("set_epoch", [])
    if calls:
        rep.attempt(todo_epoch)
    sampler = train_sampler(record)
    if sampler is None:
        if calls:
            rep.waits(todo_epoch, "set_epoch is called; it is checked once the training "
                      "DataLoader takes its batches from the sampler")
        return  # without a sampler there is nothing to tell the epoch (reported with it)
    # a rank whose order repeats reads from the second epoch on what another rank reads
    repeats = [rank for rank, r in enumerate(run.ranks) if r and len(epoch_passes(r, 0)) >= 2
               and epoch_passes(r, 0)[0] == epoch_passes(r, 0)[1]]
    if passes[0] != passes[1] and repeats:
        rep.fail(todo_epoch, f"rank {repeats[0]} reads the first epoch's order again in the "
                 "second, rank 0 a new one, so the ranks' shards overlap: every rank calls "
                 "train_sampler.set_epoch(epoch) (none under `if rank == 0:`)")
    elif passes[0] != passes[1]:
        rep.ok(todo_epoch, "every epoch has a new order")
    elif sampler and sampler["given"].get("shuffle") is False:  # reported with the sampler
        rep.waits(todo_epoch, f"a new order each epoch is checked once TODO {todo_sampler}'s "
                  "sampler shuffles")
    elif calls and len({e for _, e in calls}) == 1:
        rep.fail(todo_epoch, f"set_epoch is called with {calls[0][1]} every time: "
                 "train_sampler.set_epoch(epoch), with the epoch's number")
    elif calls and sampler is not None and all(
            record["samplers"][i] is not sampler for i, _ in calls if i is not None):
        rep.fail(todo_epoch, "set_epoch is called on another sampler than the training one")
    else:
        rep.fail(todo_epoch, "every epoch repeats the first epoch's order: call "
                 "train_sampler.set_epoch(epoch) at the start of each epoch")


def check_eval_reads(ctx, run, todo, replicas, replica_of, made_is_attempt=True,
                     todo_loader=None, split=1, given_as=None):
    """Evaluation reads every sample exactly once per replica (DistributedEvalSampler).
    split: the dataset checked, 1 validation or 2 test (the order the script builds them);
    given_as: the sampler's right arguments, where the ranks of a replica share them."""
    rep = ctx.report
    records = run.ranks
    name, var = {1: ("validation", "val"), 2: ("test", "test")}[split]
    if len(records[0].get("datasets", [])) <= split:
        return
    n_val = records[0]["datasets"][split]["len"]
    passes = [epoch_passes(r, split) for r in records]
    if not all(passes):
        return
    if made_is_attempt and any(sampler_records(r, "DistributedEvalSampler") for r in records):
        rep.attempt(todo)
    val_loaders = [l for l in records[0].get("loaders", []) if l["dataset"] == split]
    eval_samplers = [s for s in sampler_records(records[0]) if s["dataset"] == split]
    if eval_samplers and val_loaders and all(l["sampler"] is None for l in val_loaders):
        rep.fail(todo_loader or todo, f"the {name} sampler is made but its DataLoader does not "
                 f"get it: DataLoader({var}_ds, sampler={var}_sampler, ...)"
                 + (", the same for test" if split == 1 else ""))
        return False
    groups: dict[int, list] = {}
    for rank, p in enumerate(passes):
        groups.setdefault(replica_of(rank), []).append(p[0])
    if any(any(g != group[0] for g in group) for group in groups.values()):
        rep.fail(todo, f"the ranks of one replica evaluate different {name} samples: the "
                 f"{name} sampler counts replicas, not ranks"
                 + (f" ({var}_sampler = DistributedEvalSampler({var}_ds, {given_as}))"
                    if given_as else ""))
        return False
    real = [i for group in groups.values() for i in group[0] if i < n_val]
    if sorted(real) == list(range(n_val)):
        rep.ok(todo, f"evaluation reads every {name} sample exactly once")
        return True
    twice = len(real) - len(set(real))
    text = (f"evaluation reads {twice} {name} samples twice" if twice
            else f"evaluation reads {len(set(real))} of the {n_val} {name} samples")
    kinds = {s["kind"] for r in records for s in sampler_records(r) if s["dataset"] == split}
    if not twice and any(l["drop_last"] for l in val_loaders):
        # the sampler hands out every sample; the DataLoader drops the last, partial batch
        rep.fail(todo_loader or todo, f"{text}: its DataLoader has drop_last=True and drops the "
                 "last batch; drop_last=True belongs to the training DataLoader alone (not in "
                 "loader_args, which all loaders share)")
        return False
    hint = ("DistributedSampler pads by repeating samples: use DistributedEvalSampler(val_ds, "
            "num_replicas, rank) for validation and test" if "DistributedSampler" in kinds else
            "val_sampler = DistributedEvalSampler(val_ds, num_replicas, rank), the same for "
            "test, passed to their DataLoaders")
    rep.fail(todo, f"{text}: {hint}")
    return False


# ----------------------------------------------------------------------------- printing
PER_RANK_LINES = re.compile(r"^(setup: rank|WARNING: Slurm gave|\[W|\[rank|W\d{4}|I\d{4}|"
                            r"\s*$|warnings\.warn|.*UserWarning)")


def printed_by_others(run) -> list[dict]:
    """The lines ranks other than 0 printed because of the script (not the helpers' own
    per-rank lines such as setup's)."""
    lines = []
    for record in run.ranks[1:]:
        for p in record.get("prints", []) if record else []:
            if p["line"] is None and not p["by"].startswith("data.py"):
                continue
            if PER_RANK_LINES.match(p["text"]) or p["by"].startswith(("distributed_utils.py:setup",
                                                                       "warnings")):
                continue
            lines.append(p)
    return lines


def check_prints_once(ctx, run, todo, print_todo_for_line=False) -> None:
    rep = ctx.report
    others = printed_by_others(run)
    warn = [c["warn"] for r in run.ranks[:1] if r for c in r.get("load_corpus", [])]
    if any(w == "print0" for w in warn) or any(
            c["name"] == "print0" for r in run.ranks if r for c in r.get("calls", [])):
        rep.attempt(todo)
    if warn and warn[0] == "print":
        rep.fail(todo, "load_corpus_or_exit(..., warn=print) makes every rank print the data "
                 "warnings: warn=print0")
    if others:
        first = others[0]
        where = f" (line {first['line']})" if first["line"] else ""
        owner = ctx.todo_of(first["line"]) if print_todo_for_line else None
        target = owner if owner in rep.names else todo
        rep.fail(target, f"rank 1 prints too{where}: '{first['text'][:60]}': print with print0, "
                 "so only rank 0 prints")
    elif not (warn and warn[0] == "print"):
        rep.ok(todo, "rank 0 alone prints")


# ----------------------------------------------------------------------- numbers and files
STEP_LOSS = re.compile(r"\bstep\s*(\d+)\b.*?\bloss\b\s*[:=]?\s*(-?\d+\.\d+)", re.I)


def printed_losses(output: str) -> dict[int, float]:
    """{step: loss} from the script's step lines ("epoch 0 step 3 loss 3.6543 ...")."""
    found = {}
    for line in output.splitlines():
        m = STEP_LOSS.search(line)
        if m and "validation" not in line and "test" not in line:
            found[int(m.group(1))] = float(m.group(2))
    return found


def check_losses(ctx, run, ref, todo, what="the logged training losses",
                 twice=": twice the mean, a sum over 2 ranks? (all_reduce_mean, not "
                       "all_reduce_sum)") -> bool:
    """The summary's loss of every step, the printed step lines and the logged train/loss all
    equal the single-process run's losses. `twice`: what a loss twice the right one says."""
    rep = ctx.report
    mine, theirs = run.summary["loss_history"], ref.summary["loss_history"]
    i = first_difference(mine, theirs)
    if i is not None:
        if len(mine) != len(theirs) and (i == len(mine) or i == len(theirs)):
            rep.fail(todo, f"{len(mine)} training steps logged, the single-process run takes "
                     f"{len(theirs)}")
        else:
            rep.fail(todo, f"{what} differ from the single-process run from step {i + 1} on "
                     f"({mine[i]:.5f} vs {theirs[i]:.5f})"
                     + ratio_hint(mine[i], theirs[i], twice))
        return False
    printed = printed_losses(run.outputs[0])
    wrong = [(s, v) for s, v in printed.items() if 1 <= s <= len(theirs)
             and not near(v, theirs[s - 1], 1e-3, 1e-3)]
    if wrong:
        s, v = wrong[0]
        rep.fail(todo, f"the step lines print another loss than the one in summary.json "
                 f"(step {s}: printed {v:.4f}, the mean over ranks is {theirs[s - 1]:.4f})"
                 + ratio_hint(v, theirs[s - 1], twice))
        return False
    logged = [(e["step"], e["metrics"]["train/loss"]) for e in run.ranks[0].get("logged", [])
              if "train/loss" in e["metrics"]]
    wrong = [(s, v) for s, v in logged if 1 <= s <= len(theirs) and not near(v, theirs[s - 1])]
    if wrong:
        s, v = wrong[0]
        rep.fail(todo, f"the logger gets another train/loss than summary.json (step {s}: "
                 f"{v:.4f} vs {theirs[s - 1]:.4f})")
        return False
    rep.ok(todo, f"{what} equal the single-process run ({len(mine)} steps)")
    return True


def ratio_hint(mine: float, theirs: float, twice: str) -> str:
    if theirs and near(mine / theirs, 2.0, 0.02):
        return twice
    if theirs and near(mine, 0.0, 0, 1e-6):
        return ": 0, taken from a rank that computes no loss?"
    return ""


def check_tokens(ctx, run, todo, tokens_per_step, how, prefix: str = "") -> None:
    """Throughput.step gets the tokens of the whole step over all replicas. prefix: which run
    it was ("on two nodes (tp 1, dp 2) "), for a step that runs several."""
    counts = set(run.ranks[0].get("tokens", []))
    others = [rank for rank, r in enumerate(run.ranks) if rank and r and r.get("tokens")]
    if not counts and others:  # rank 0's monitor prints tokens/s: it must count them too
        ctx.report.fail(todo, f"{prefix}only rank {' and '.join(map(str, others))} counts "
                        "tokens, and rank 0, which prints tokens/s and MFU, counts none: "
                        f"throughput.step on every rank, {how.rpartition(': ')[2]}")
        return
    if not counts:
        return
    if counts == {tokens_per_step}:
        ctx.report.ok(todo, f"tokens are counted once per step and replica ({tokens_per_step})")
    else:
        got = max(counts)
        factor = f" ({got / tokens_per_step:g} x)" if tokens_per_step else ""
        ctx.report.fail(todo, f"{prefix}throughput.step gets {got} tokens per step, the step "
                        f"trains on {tokens_per_step}{factor}: {how}")


def written_elsewhere(run, name) -> str | None:
    """Where rank 0 wrote a file of this name instead of the run's folder, with the line (None
    if it did not)."""
    for s in (run.ranks[0] or {}).get("saves", []) if run.ranks else []:
        path = Path(s["path"])
        if path.name == name and path.parent != run.out and not (run.out / name).exists():
            folder = "the current folder" if str(path.parent) == "." else str(path.parent)
            return f"{folder} (line {s['line']})"
    return None


def check_weights_file(ctx, run, ref, todo, name, ref_name="final_model.pt", how="",
                       save_with="") -> None:
    """The weights file `name` of the run against the reference's: written into --out-dir
    (`save_with` says how, where it went elsewhere), loading into a plain model, equal."""
    rep = ctx.report
    path = run.out / name
    elsewhere = written_elsewhere(run, name)
    if elsewhere and save_with:
        rep.fail(todo, f"{name} is written into {elsewhere}, not into the run's folder "
                 f"--out-dir: {save_with}")
        return
    if not path.exists():
        rep.fail(todo, f"{name} was not written{how}")
        return
    try:
        mine = load_weights(path, run.summary["model_config"])
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - any failure to load is the participant's news
        # (DCP's CheckpointException is a BaseException)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        missing = re.search(r"Missing key in checkpoint state_dict: ([\w.]+)", str(e))
        if missing:
            first = f"it has no {missing.group(1)} (no stage saved it)"
        hint = (" (its keys start with 'module.': save the model inside the DDP wrapper, "
                "save0(model, path) unwraps it)" if "module." in str(e) else "")
        if "DTensor" in str(e):  # torch.save of a sharded model's own state dict
            first = "it holds DTensors, each rank's shards of the weights, not plain tensors"
            hint = (": save_full_model(model, path), called on every rank, gathers the whole "
                    "model and writes it once")
        prefix = saved_key_prefix(path) if missing and not hint else None
        if prefix:  # the whole model's keys, under another name: a state dict inside a dict
            first = (f"its keys start with '{prefix}' ({prefix}layers.0...): save the state "
                     "dict itself, dcp.save(model.state_dict(), checkpoint_id=folder), not a "
                     "dict around it")
        rep.fail(todo, f"{name} does not load into a plain TransformerLM: {first}{hint}")
        return
    theirs = load_weights(ref.out / ref_name, ref.summary["model_config"])
    if weights_close(mine, theirs):
        rep.ok(todo, f"{name} loads into a plain model and holds the single-process weights")
    else:
        rep.fail(todo, f"{name} loads, but its weights differ from the single-process run")


def saved_key_prefix(path) -> str | None:
    """'model.' when every key of a DCP folder is a plain model's key behind that prefix."""
    if not path.is_dir():
        return None
    try:
        from torch.distributed.checkpoint import FileSystemReader
        keys = list(FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    except Exception:  # noqa: BLE001 - no metadata to read: no hint
        return None
    m = [re.match(r"(.+?\.)(?:tok_emb|pos_emb|layers|norm|output)\.", k) for k in keys]
    prefixes = {x.group(1) for x in m if x}
    return prefixes.pop() if len(prefixes) == 1 and all(m) else None


def check_eval_exact(ctx, run, todo, hint):
    """The probe evaluated the same model on the whole split in one process: compare."""
    pairs = [(e["value"], e["full"]) for e in run.ranks[0].get("evals", []) if "full" in e]
    if not pairs:
        ctx.report.fail(todo, "evaluate() was not called as expected")
        return False
    if all(near(v, f, 1e-6, 1e-7) for v, f in pairs):
        ctx.report.ok(todo, "validation and test losses equal the single-process evaluation "
                      "exactly")
        return True
    v, f = next(p for p in pairs if not near(p[0], p[1], 1e-6, 1e-7))
    ctx.report.fail(todo, f"evaluate() returned {v:.6f} on rank 0, the whole split gives "
                    f"{f:.6f}: {hint}")
    return False


SEED_ALIKE = ("leave the seed as setup() gave it, alike on every rank (no torch.manual_seed(... + "
              "rank) before the model is built)")


def rank_with_other_initial_weights(run) -> int | None:
    """The first rank whose model was built with other initial weights than rank 0's (a seed per
    rank before it), else None. DDP broadcasts rank 0's weights; fully_shard, apply_tp and a
    pipeline's stages keep each rank's own share of its own model: a mix of models."""
    built = [(r or {}).get("initial_weights") for r in run.ranks]
    return next((rank for rank, w in enumerate(built) if w and built[0] and w != built[0]), None)


def calls(run, name, rank=None):
    return [c for r, record in enumerate(run.ranks) if record and (rank is None or r == rank)
            for c in record.get("calls", []) if c["name"] == name]


TOKENS_PER_SAMPLE = SEQ_LEN


def inner_units(units) -> str:
    """What FSDP units inside the blocks, in place of the blocks, cost."""
    inner = units["inner"]
    named = ", ".join(inner[:3]) + (", ..." if len(inner) > 3 else "")
    return (f"the FSDP units are parts of the blocks ({named}), not the blocks: "
            f"{len(inner)} smaller all-gathers where {len(units['blocks'])} would do, and the "
            "blocks' other parameters (layer norms) fall to the root's unit")
