"""The memory step, train/memory_training.py (TODOs 55-58): activation checkpointing, FSDP2
layouts and offload, ZeRO-1, gradient accumulation.

Every way of saving memory must train exactly what one process trains on the same global batch,
and must save what it promises. Your script runs as two nodes with one process each, next to
the solution in one process with the whole batch, in every layout (ddp, zero1, zero2, zero3,
offload), each layout once with --grad-accum and once with --activation-checkpointing (ddp:
once with both, once with neither), so that every layout meets every option and every two
options meet at least once. A mistake that shows only in one layout, or only with one option,
shows here. Two layouts accumulate 4 micro-batches, the others 2: a step counted right for 2
only (a 2 written in for args.grad_accum) shows too.

What a run promises is read from what it built (the probe): which modules are FSDP units, whether
each reshards after forward and keeps its shards in host memory, the optimizer's class and the
learning rate and weight decay it runs with, which blocks are checkpoint-wrapped; and from what
it measured (utils/memory.py's breakdown in summary.json: tensors counted, not text read) against
the formula. DDP's all-reduces and FSDP's reduce-scatters are counted (a micro-batch outside
no_gradient_sync talks to the other ranks). The offload run with checkpointing runs on a stand-in
GPU (selfcheck/standin.py), where the offload policy pins host memory.
"""

from __future__ import annotations

import re
import types

from selfcheck import standin
from selfcheck.compare import first_difference, near
from selfcheck.runs import ONE, TWO_NODES, Run
from selfcheck.steps.common import (SEED_ALIKE, SEQ_LEN, check_losses, crash_todo,
                                    inner_units, rank_with_other_initial_weights, report_crash)

FILE = "train/memory_training.py"
WHAT = "memory: activation checkpointing, FSDP2 layouts and offload, ZeRO-1, accumulation"
TODOS = {55: "activation checkpointing", 56: "FSDP2 layouts and offload", 57: "ZeRO-1",
         58: "gradient accumulation"}
CHECKPOINTING, FSDP, ZERO1, ACCUMULATION = 55, 56, 57, 58
WHOLE_BATCH = 8  # per optimizer step, over both ranks and all micro-batches
COUNT = {"CHECK_COUNT_ALLREDUCES": "1"}
OPTIONAL = {"--grad-accum": 1, "--layout": 1, "--activation-checkpointing": 0}
LAYOUT_TODO = {"ddp": None, "zero1": ZERO1, "zero2": FSDP, "zero3": FSDP, "offload": FSDP}
FSDP_LAYOUTS = ("zero2", "zero3", "offload")
# (layout, micro-batches per step, activation checkpointing): each layout with accumulation and
# with checkpointing, and every pair of the three options at least once; 4 micro-batches (of one
# sample each) in two layouts, where a loop right for 2 only goes wrong
COMBINATIONS = [("ddp", 1, False), ("ddp", 2, True),
                ("zero1", 4, False), ("zero1", 1, True),
                ("zero2", 2, False), ("zero2", 1, True),
                ("zero3", 4, False), ("zero3", 1, True),
                ("offload", 2, False), ("offload", 1, True)]
ON_A_GPU = ("offload", 1, True)  # the stand-in GPU's run


def fail(rep, todo: int, text: str) -> None:
    """One FIX per TODO: the first run that shows it (many runs show the same mistake)."""
    if not rep.failed(todo):
        rep.fail(todo, text)


def flags(key) -> str:
    layout, accum, ckpt = key
    return " ".join([f"--layout {layout}", *([f"--grad-accum {accum}"] if accum > 1 else []),
                     *(["--activation-checkpointing"] if ckpt else [])])


def check(ctx) -> None:
    ref = Run(ctx.work, "reference", ctx.root / "solutions" / FILE, WHOLE_BATCH, geometry=ONE,
              reference=True, env=COUNT)
    runs = {}
    for key in COMBINATIONS:
        layout, accum, ckpt = key
        extra = ["--layout", layout]
        extra += ["--grad-accum", str(accum)] if accum > 1 else []
        extra += ["--activation-checkpointing"] if ckpt else []
        gpu = key == ON_A_GPU
        extra += ["--precision", "fp32"] if gpu else []  # (auto would be bf16 on a GPU)
        runs[key] = Run(ctx.work, flags(key).replace("--", "").replace(" ", "-"), ctx.script,
                        WHOLE_BATCH // (2 * accum), geometry=TWO_NODES, env=COUNT, extra=extra,
                        optional=OPTIONAL, gpu=gpu)
    for run in runs.values():
        run.wait()
    ref.wait()
    if ref.crashed:
        raise RuntimeError(f"the reference run failed: {ref.failure and ref.failure.message}")
    finished = {}
    for key, run in runs.items():
        if run.crashed:
            report_run_crash(ctx, key, run, runs)
        elif run.summary and run.summary["args"].get("layout") == key[0]:
            finished[key] = run
    # what each run built and measured first: where it breaks a promise, that is the cause of
    # any difference in training too
    check_same_models_sharded(ctx, finished)
    check_too_few_syncs(ctx, finished, ref)
    for key, run in finished.items():
        check_promises(ctx, key, run, ref, finished)
    trained = {key: same_training(ctx, run, ref, key) for key, run in finished.items()}
    blame_training(ctx, trained, finished, ref)
    say_ok(ctx, trained)


# ------------------------------------------------------------------------------ ok lines
def passed(ctx, todo: int, key, detail: str = "") -> None:
    """A run in which `todo` did what it promises; said once all runs are judged (say_ok)."""
    ctx.extra.setdefault("passed", {}).setdefault(todo, {}).setdefault(key, detail)


def where_it_ran(keys, todo: int) -> str:
    """'in every layout', or the layouts of the runs of this TODO's option that got this far."""
    ran = [layout for layout in LAYOUT_TODO if any(k[0] == layout for k in keys)]
    wanted = {k[0] for k in COMBINATIONS if todo in option_todos(k)}
    return ("in every layout" if set(ran) >= wanted else
            f"in the layouts that ran ({', '.join(ran)})")


def say_ok(ctx, trained: dict) -> None:
    """One ok line per TODO that no run failed, claiming only what the runs showed: the
    layouts that ran with its option (a layout whose TODO is not done yet did not), and the
    same losses as one process only where all of them had them."""
    rep = ctx.report
    for todo, runs in ctx.extra.get("passed", {}).items():
        if rep.failed(todo):
            continue
        keys = list(runs)
        same = all(trained.get(key) is True for key in keys)
        if todo == CHECKPOINTING:
            rep.ok(todo, f"each block keeps only its input: {runs[keys[0]]} of the activations, "
                   f"{where_it_ran(keys, todo)}" + (", the same losses" if same else ""))
        elif todo == FSDP:
            ran = {key[0] for key in keys}
            said = [text for layout, text in (
                ("zero2", "zero2 keeps every block gathered until backward"),
                ("zero3", "zero3 frees the blocks' gathered weights after forward"),
                ("offload", "offload keeps every unit's shards in host memory"))
                if layout in ran]
            rep.ok(todo, ", ".join(said) + ("; all train like one process" if same else ""))
        elif todo == ACCUMULATION:
            counts = " and ".join(str(n) for n in sorted({key[1] for key in keys}))
            rep.ok(todo, f"{counts} micro-batches per step " + ("train like one process with the whole "
                   "batch " if same else "") + f"{where_it_ran(keys, todo)}, the gradients "
                   "reduced once per step")


# ------------------------------------------------------------------------------ crashes
def report_run_crash(ctx, key, run, runs) -> None:
    """The first crash of each TODO, with the options of the run it happened in."""
    rep = ctx.report
    layout, accum, ckpt = key
    f = run.failure
    message = f.message if f else ""
    default = (CHECKPOINTING if "apply_activation_checkpointing" in message or ckpt and not
               LAYOUT_TODO[layout] else LAYOUT_TODO[layout] or ACCUMULATION)
    cause, todo = None, None
    # ranks that disagree on their collectives only where micro-batches are accumulated: the
    # ranks skip different all-reduces (no_gradient_sync on some ranks, or some micro-batches)
    mismatch = f is not None and (f.kind in ("hung", "timeout") or f.peer
                                  or "collective mismatch" in message)
    if accum > 1 and mismatch and all(not r.crashed for k, r in runs.items() if k[1] == 1):
        default = ACCUMULATION
        cause = ("every rank must make the same all-reduces: no_gradient_sync(model) around the "
                 "same micro-batches on every rank, all but the last of each step")
    if "no_sync" in message and layout in ("zero2", "zero3", "offload"):
        cause = ("FSDP2's modules have no no_sync(): no_gradient_sync(model) calls DDP's "
                 "no_sync() or FSDP2's set_requires_gradient_sync(False), whichever the model is")
        todo = ACCUMULATION
    elif (option := crashing_option(runs)) is not None:
        # the lines that crash run fine without this option: the option's code is the cause
        todo, cause = option, option_crash_cause(option, message) or cause
    if layout in FSDP_LAYOUTS and zero_optimizers(run):
        todo, cause = ZERO1, ZERO_WITH_FSDP
    if key == ON_A_GPU and standin.beyond_the_standin(f):
        rep.note(f"(the check's stand-in GPU could not follow line {f.line}: {f.message}; the "
                 f"{flags(key)} run is not judged)")
        return
    target = todo or (crash_todo(ctx, f) if f else None) or default
    if rep.failed(target):
        return  # said already, for another run
    report_crash(ctx, run, todo=target, cause=cause, prefix=f"with {flags(key)}, ")
    rep.note(f"(full output of the {flags(key)} run: {run.dir / 'output.txt'})")


def option_todos(key) -> set[int]:
    """The TODOs whose code a run with these options runs (ddp without options: none)."""
    layout, accum, ckpt = key
    return ({LAYOUT_TODO[layout]} - {None}) | ({ACCUMULATION} if accum > 1 else set()) | \
        ({CHECKPOINTING} if ckpt else set())


def crashing_option(runs: dict) -> int | None:
    """The TODO of the one option that every run that crashed uses and every run that finished
    goes without (every --activation-checkpointing run, and only those: TODO 55), else None.
    A crash of the stand-in GPU's own is left out: it says nothing about the options."""
    judged = {key: run for key, run in runs.items() if not (
        key == ON_A_GPU and run.crashed and standin.beyond_the_standin(run.failure))}
    crashed = {key for key, run in judged.items() if run.crashed}
    return next((todo for todo in TODOS
                 if crashed == {key for key in judged if todo in option_todos(key)}), None)


FUNCTION_OF = {CHECKPOINTING: "apply_activation_checkpointing", FSDP: "apply_fsdp"}
# (pattern in the error, what to change) for crashes of the checkpointing runs alone
CHECKPOINTING_CRASHES = [
    (r"'str' object is not callable|'str' object has no attribute",
     "iterating model.layers gives the blocks' names: checkpoint_wrapper(model.layers[name]), "
     "the block, not its name"),
    (r"'\w*CheckpointWrapper' (has no len|object is not (iterable|subscriptable)|object has no "
     r"attribute '(values|items|keys)')",
     "model.layers is a ModuleDict, which the script and the course's helpers walk block by "
     "block: wrap each block of model.layers, not the ModuleDict (for name in "
     "list(model.layers): model.layers[name] = checkpoint_wrapper(model.layers[name]))"),
]


def option_crash_cause(todo: int, message: str) -> str | None:
    """What to change for a crash that only the runs of one option have."""
    function = FUNCTION_OF.get(todo)
    if function and "'NoneType' object" in message:
        return (f"{function} must return the model (return model at its end): the script goes "
                f"on with what it returns, model = {function}(model, ...)")
    if todo == CHECKPOINTING:
        return next((cause for pattern, cause in CHECKPOINTING_CRASHES
                     if re.search(pattern, message)), None)
    return None


# ------------------------------------------------------------------------------ training
def memory(run, key: str, rank: int = 0):
    return run.summary["memory"]["per_rank"][rank]["measured"][key]


def formula(run, key: str, rank: int = 0):
    return run.summary["memory"]["per_rank"][rank]["formula"][key]


def tokens(run, rank: int = 0):
    return run.summary["memory"]["per_rank"][rank]["tokens_per_microbatch"]


def grad_norms(run) -> dict[int, float]:
    return {e["step"]: e["metrics"]["train/grad_norm"] for e in run.ranks[0].get("logged", [])
            if "train/grad_norm" in e["metrics"]}


def compared_norms(run, ref) -> list[tuple[int, float, float]]:
    """(step, the run's gradient norm, the single process's) for the steps both logged. A norm
    of exactly 0 is left out: the monitor reads the gradients when it reports, after the step,
    and a zero_grad() right after optimizer.step() (right too) has cleared them by then."""
    mine, theirs = grad_norms(run), grad_norms(ref)
    return [(s, mine[s], theirs[s]) for s in sorted(mine) if s in theirs and mine[s] != 0.0]


def first_norm_ratio(run, ref) -> float | None:
    """The run's gradient norm over the single process's, at the first step both logged."""
    pairs = compared_norms(run, ref)
    return pairs[0][1] / pairs[0][2] if pairs and pairs[0][2] else None


def same_training(ctx, run, ref, key):
    """True when losses and gradient norms of every step equal the single-process run's; else
    (TODO-less) what differs, for blame_training to put under the right TODO."""
    class Quiet:  # check_losses's verdicts, caught instead of reported
        def __init__(self):
            self.lines = []

        def ok(self, todo, text):
            pass

        def fail(self, todo, text):
            self.lines.append(text)

    quiet = Quiet()
    real = ctx.report
    ctx.report = quiet
    try:
        check_losses(ctx, run, ref, 0, f"the losses with {flags(key)}")
    finally:
        ctx.report = real
    if quiet.lines:
        return quiet.lines[0]
    differ = [(s, m, t) for s, m, t in compared_norms(run, ref) if not near(m, t, 1e-4)]
    if differ:
        step, m, t = differ[0]
        ratio = m / t if t else float("nan")
        return (f"with {flags(key)} the gradients differ from the single-process run's from step "
                f"{step} on (norm {m:.4g} vs {t:.4g}"
                + (f", {ratio:.2g} times as large" if near(ratio, round(ratio), 0.02)
                   and round(ratio) > 1 else "") + ")")
    return True


def features(key) -> list[str]:
    layout, accum, ckpt = key
    return ([f"layout {layout}"] if LAYOUT_TODO[layout] else []) + \
        (["accumulation"] if accum > 1 else []) + (["checkpointing"] if ckpt else [])


def feature_todo(feature: str) -> int:
    if feature.startswith("layout"):
        return LAYOUT_TODO[feature.split()[1]]
    return {"accumulation": ACCUMULATION, "checkpointing": CHECKPOINTING}[feature]


def one_factor(trained: dict, runs: dict, ref, factor) -> float | None:
    """The one value, other than 1, that factor(key, ratio) takes for every run compared
    (ratio: its first logged loss over the single process's), else None."""
    theirs = ref.summary["loss_history"]
    values = [factor(key, runs[key].summary["loss_history"][0] / theirs[0]) for key in trained
              if theirs and runs[key].summary["loss_history"]]
    if not values or len(values) < len(trained) or near(values[0], 1.0, 0.01) or \
            not all(near(v, values[0], 0.01) for v in values):
        return None
    return values[0]


def scaled_everywhere(ctx, trained: dict, runs: dict, ref) -> bool:
    """Every run, with accumulation or without, logs the same multiple of the single process's
    loss: the loss itself is scaled (by the ranks, say), not any one option's work. True if
    reported (once, under the TODO that divides the loss)."""
    if not trained or any(good is True for good in trained.values()):
        return False
    ratio = one_factor(trained, runs, ref, lambda key, ratio: ratio)
    if ratio is None:
        return False
    world = next(iter(runs.values())).geometry.world
    why = (f"; DDP and FSDP average the gradients over the {world} ranks themselves"
           if near(ratio, 1 / world, 0.01) else "")
    fail(ctx.report, ACCUMULATION, f"in every run, with accumulation or without, the loss is "
         f"{ratio:.3g} x the single process's from step 1 on: divide each micro-batch's loss by "
         f"args.grad_accum only{why}")
    return True


def divided_by_a_number(ctx, trained: dict, runs: dict, ref) -> bool:
    """Every run's loss is (its micro-batches) / (one number) times the single process's: the
    loss is divided by that number where args.grad_accum belongs (by world_size, say), which
    trains right only where the two are equal. True if reported (under the TODO that divides)."""
    if all(good is True for good in trained.values()) or len({key[1] for key in trained}) < 2:
        return False
    divisor = one_factor(trained, runs, ref, lambda key, ratio: key[1] / ratio)
    if divisor is None:
        return False
    world = next(iter(runs.values())).geometry.world
    instead = (f"not by the ranks: DDP and FSDP average the gradients over the {world} ranks "
               "themselves" if near(divisor, world, 0.01) else "by nothing else")
    fail(ctx.report, ACCUMULATION, f"every run divides its loss by {divisor:.3g}, whatever "
         f"--grad-accum (without accumulation the loss is {1 / divisor:.3g} x the single "
         f"process's from step 1 on): divide each micro-batch's loss by args.grad_accum, "
         f"{instead}")
    return True


def same_gradients(run, ref) -> bool:
    pairs = compared_norms(run, ref)
    return bool(pairs) and all(near(m, t, 1e-4) for _, m, t in pairs)


def blame_training(ctx, trained: dict, runs: dict, ref) -> None:
    """A run that trains differently: its TODO is that of an option no run that trains right
    uses (with accumulation 2, a loss twice the whole batch's is the undivided loss). Where a
    TODO has a FIX already (a promise broken, a run that crashed), that is the cause: the
    other TODOs' losses wait for it."""
    rep = ctx.report
    earlier = [n for n in sorted(TODOS) if rep.failed(n)]
    if not earlier and (scaled_everywhere(ctx, trained, runs, ref)
                        or divided_by_a_number(ctx, trained, runs, ref)):
        return
    cleared = {f for key, good in trained.items() if good is True for f in features(key)}
    for key, what in trained.items():
        if what is True:
            continue
        run = runs[key]
        mine, theirs = run.summary["loss_history"], ref.summary["loss_history"]
        ratio = first_norm_ratio(run, ref)
        stale = ((run.ranks[0] or {}).get("optimizer_calls") or {}).get("steps_on_old_grads")
        if stale:  # a cause seen, not inferred: said whatever else failed
            fail(rep, ACCUMULATION, f"with {flags(key)} {stale} of {run.summary['steps']} "
                 "optimizer steps ran without optimizer.zero_grad() since the step before, on "
                 "its gradients too: zero_grad once per optimizer step, before its first "
                 "micro-batch (if micro % args.grad_accum == 0)")
            continue
        if key[1] > 1 and mine and theirs and first_difference(mine, theirs) is None and \
                ratio is not None and near(ratio, 1 / key[1], 0.02):
            # (AdamW's step hardly depends on the gradients' scale: the losses stay right)
            todo, what = ACCUMULATION, (f"with {flags(key)} the logged loss is right, but the "
                                        f"gradients are 1/{key[1]} of the whole batch's from "
                                        "step 1 on: backward() gets the loss divided by "
                                        "args.grad_accum twice; divide it once")
        elif key[1] > 1 and mine and theirs and near(mine[0] / theirs[0], 1 / key[1], 0.02) \
                and same_gradients(run, ref):
            todo, what = ACCUMULATION, (f"with {flags(key)} the gradients are right, but every "
                                        f"step's logged loss is 1/{key[1]} of the whole batch's: "
                                        "the micro-batches' divided losses add up to the "
                                        "batch's, torch.stack(micro_losses).sum(), not .mean()")
        elif key[1] > 1 and mine and theirs and near(mine[0] / theirs[0], key[1], 0.02) and \
                same_gradients(run, ref):
            todo, what = ACCUMULATION, (f"with {flags(key)} the gradients are right, but every "
                                        f"step's logged loss is {key[1]} x the whole batch's: log "
                                        "the divided loss, the one backward() gets (loss = "
                                        "F.cross_entropy(...) / args.grad_accum, then "
                                        "loss.backward())")
        elif key[1] > 1 and mine and theirs and near(mine[0] / theirs[0], 2.0, 0.02):
            todo, what = ACCUMULATION, (f"with {flags(key)} every step's loss is twice the whole "
                                        "batch's: divide each micro-batch's loss by "
                                        "args.grad_accum before backward()")
        else:
            suspects = [f for f in features(key) if f not in cleared] or features(key)
            # several suspects: the accumulation loop first (where the step is made), then the
            # layout, then checkpointing
            order = ("accumulation", "layout", "checkpointing")
            suspects.sort(key=lambda f: order.index(f.split()[0]))
            todo = feature_todo(suspects[0]) if suspects else ACCUMULATION
        if rep.failed(todo):
            continue
        if earlier:
            rep.waits(todo, f"the losses with {flags(key)} are compared once TODO {earlier[0]} "
                      "is fixed")
        else:
            fail(rep, todo, what)


# ------------------------------------------------------------------------------ promises
def check_promises(ctx, key, run, ref, runs) -> None:
    """What the run's options promise, on the objects it built and the bytes it measured."""
    layout, accum, ckpt = key
    if layout in FSDP_LAYOUTS:
        check_fsdp(ctx, key, run, ref)
        if zero_optimizers(run):
            fail(ctx.report, ZERO1, f"with {flags(key)} the optimizer is a "
                 f"ZeroRedundancyOptimizer too: {ZERO_WITH_FSDP}")
    else:
        check_replicated(ctx, key, run, ref)
    if ckpt:
        check_checkpointing(ctx, key, run, ref)
    elif any("CheckpointWrapper" in t for t in (run.ranks[0] or {}).get("block_types", [])):
        fail(ctx.report, CHECKPOINTING, f"with {flags(key)}, no --activation-checkpointing, the "
             "blocks are checkpoint_wrapper's: every step runs their forward twice, though the "
             "run did not ask for it; checkpoint them only under "
             "`if args.activation_checkpointing:`")
    if not check_micro_batches_per_step(ctx, key, run) and accum > 1:
        check_accumulation(ctx, key, run, ref, runs)
        check_step_tokens(ctx, key, run)


def check_micro_batches_per_step(ctx, key, run) -> bool:
    """Every optimizer step after the first made after args.grad_accum micro-batches, with or
    without accumulation (a count right for 2 only goes wrong at 1 and 4): True if reported."""
    calls = (run.ranks[0] or {}).get("optimizer_calls") or {}
    later = (calls.get("backwards_per_step") or [])[1:]
    wrong = sorted({n for n in later if n != key[1]})
    if not wrong or key[1] > 1 and wrong == [1]:
        return False  # (a step per micro-batch: check_accumulation says it in its own words)
    how = (f"{key[1]} micro-batch per step, no --grad-accum" if key[1] == 1 else
           f"args.grad_accum = {key[1]}")
    fail(ctx.report, ACCUMULATION, f"with {flags(key)} the optimizer stepped "
         f"after {' or '.join(map(str, wrong))} micro-batches instead of {how}: count the step's "
         "micro-batches by args.grad_accum, never a number written in (last = micro % "
         "args.grad_accum == 0)")
    return True


def check_step_tokens(ctx, key, run) -> None:
    """One throughput.step per optimizer step, with the tokens of every micro-batch on every
    rank: tokens/s and MFU are per step."""
    counted = (run.ranks[0] or {}).get("tokens", []) if run.ranks else []
    steps, want = run.summary.get("steps") or 0, WHOLE_BATCH * SEQ_LEN
    how = ("once per optimizer step (after `if not last: continue`), "
           "throughput.step(x.numel() * world_size * args.grad_accum)")
    if not counted or not steps:
        return
    if len(counted) > steps:
        fail(ctx.report, ACCUMULATION, f"with {flags(key)} throughput.step is called "
             f"{len(counted)} times in {steps} steps, once per micro-batch: tokens/s counts "
             f"every step {len(counted) / steps:g} times; {how}")
    elif set(counted) != {want}:
        got = max(counted)
        fail(ctx.report, ACCUMULATION, f"with {flags(key)} throughput.step gets {got} tokens "
             f"per step, a step trains on {want} ({got / want:g} x: every micro-batch of every "
             f"rank); {how}")


ZERO_WITH_FSDP = ("FSDP shards AdamW's state itself: a ZeroRedundancyOptimizer for --layout zero1 "
                  "only, the plain torch.optim.AdamW(model.parameters(), ...) for the FSDP layouts")


def zero_optimizers(run) -> list[dict]:
    """The ZeroRedundancyOptimizers rank 0 built (a crashed run's record too)."""
    record = run.ranks[0] if run.ranks else None
    return [o for o in (record or {}).get("optimizers", [])
            if o["class"] == "ZeroRedundancyOptimizer"]


def check_replicated(ctx, key, run, ref) -> None:
    """ddp and zero1: DDP; AdamW's state whole (ddp) or sharded with AdamW's arguments (zero1)."""
    rep = ctx.report
    layout = key[0]
    r0 = run.ranks[0]
    values = (r0.get("parser") or {}).get("values", {})
    zero = zero_optimizers(run)
    if zero:
        rep.attempt(ZERO1)
    mine, whole = memory(run, "optimizer"), memory(ref, "optimizer")
    if layout == "ddp":
        if zero or mine < 0.75 * whole:
            fail(rep, ZERO1, f"with {flags(key)} AdamW's state is sharded too ({mine / whole:.0%} "
                     "on each rank): a ZeroRedundancyOptimizer for --layout zero1 only, the "
                     "plain AdamW for the others")
        return
    if not zero:
        fail(rep, ZERO1, f"with {flags(key)} every rank holds AdamW's whole state ({mine} bytes): "
                 "make the optimizer a ZeroRedundancyOptimizer for --layout zero1")
        return
    z = zero[0]
    if (z["optimizer_class"] or "").startswith("_Functional"):
        # overlap_with_ddp=True swaps AdamW for its functional form, stepped by a DDP
        # communication hook this script never registers
        fail(rep, ZERO1, f"the ZeroRedundancyOptimizer runs {z['optimizer_class']}, made for "
             "overlap_with_ddp=True, which needs a DDP communication hook to step it: drop "
             "overlap_with_ddp=True, ZeroRedundancyOptimizer(model.parameters(), "
             "optimizer_class=torch.optim.AdamW, **adamw)")
        return
    if z["optimizer_class"] != "AdamW":
        fail(rep, ZERO1, f"the ZeroRedundancyOptimizer runs {z['optimizer_class']}, the course "
                 "trains with AdamW: optimizer_class=torch.optim.AdamW")
        return
    wrong = [f"{name}={z[name]:g} where the run asks for {values[name]:g}"
             for name in ("lr", "weight_decay") if name in values and z.get(name) is not None
             and not near(z[name], values[name], 1e-9, 0)]
    if wrong:
        fail(rep, ZERO1, f"the ZeroRedundancyOptimizer's AdamW runs with {' and '.join(wrong)} "
             "(AdamW's defaults): pass AdamW's arguments on, ZeroRedundancyOptimizer(..., "
             "optimizer_class=torch.optim.AdamW, lr=args.lr, weight_decay=args.weight_decay)")
        return
    if mine > 0.75 * whole:
        fail(rep, ZERO1, f"with {flags(key)} every rank holds AdamW's whole state ({mine} bytes): "
                 "the ZeroRedundancyOptimizer must get the model's parameters")
        return
    rep.ok(ZERO1, f"each rank holds {mine / whole:.0%} of AdamW's state (ZeroRedundancyOptimizer "
           "of AdamW with its arguments), the same losses")


def check_fsdp(ctx, key, run, ref) -> None:
    """zero2, zero3, offload: every block and the root FSDP units; resharding and offload per
    unit as the layout says; the parameters sharded."""
    rep = ctx.report
    layout = key[0]
    r0 = run.ranks[0]
    units = r0.get("fsdp")
    rep.attempt(FSDP)
    if not units:
        fail(rep, FSDP, f"with {flags(key)} no module is an FSDP unit: apply_fsdp must "
                 "fully_shard each block of model.layers, then the whole model")
        return
    plain = [i for i, is_unit in enumerate(units["blocks"]) if not is_unit]
    if units.get("inner") and len(plain) == len(units["blocks"]):
        fail(rep, FSDP, f"with {flags(key)} {inner_units(units)}: fully_shard(block, ...) for "
             "every block of model.layers, then fully_shard(model, ...)")
        return
    if plain:
        which = ("no block is" if len(plain) == len(units["blocks"])
                 else f"block(s) {plain} are not")
        only = ", only the root" if units["root"] else ""
        fail(rep, FSDP, f"with {flags(key)} {which} an FSDP unit{only}: then a rank gathers the "
                 "whole model at once, with no overlap; fully_shard(block, ...) for every block "
                 "of model.layers, then fully_shard(model, ...)")
        return
    if not units["root"]:
        fail(rep, FSDP, f"with {flags(key)} the root is not an FSDP unit (the embeddings and the "
                 "output layer stay whole on every rank): after the blocks, "
                 "fully_shard(model, ...)")
        return
    want = layout != "zero2"
    reshard = units.get("reshard_after_forward", [])
    if any(flag is not None and flag != want for flag in reshard):
        if layout == "zero2":
            why = ("--layout zero2 frees the blocks' gathered weights after forward: "
                   "reshard_after_forward=False for zero2 (True for zero3 and offload)")
        else:
            why = (f"--layout {layout} keeps the blocks' gathered weights until backward: it "
                   f"frees them after forward, reshard_after_forward=True for {layout}")
        fail(rep, FSDP, why)
        return
    # (None: FSDP's internals did not say)
    blocks = [None if p is None else p == "CPUOffloadPolicy" for p in units.get("offload", [])]
    root = units.get("root_offload")
    root = None if root is None else root == "CPUOffloadPolicy"
    offloaded = [o for o in [*blocks, root] if o is not None]
    if layout == "offload" and not all(offloaded):
        kept = [i for i, o in enumerate(blocks) if o is False]
        which = ([("the blocks" if len(kept) == len(blocks) else
                   f"block{'s' if len(kept) > 1 else ''} {', '.join(map(str, kept))}")]
                 if kept else []) + (["the root"] if root is False else [])
        done = sum(offloaded)
        have = (f"{done} of the {len(offloaded)} FSDP units {'has' if done == 1 else 'have'} "
                f"offload_policy=CPUOffloadPolicy(); missing: {' and '.join(which)}" if done
                else "no FSDP unit has offload_policy=CPUOffloadPolicy()")
        fail(rep, FSDP, f"with --layout offload, {have}. Pass it in every fully_shard call, "
             "blocks and root")
        return
    if layout != "offload" and any(offloaded):
        fail(rep, FSDP, f"--layout {layout} offloads to host memory: CPUOffloadPolicy for "
                 "--layout offload only")
        return
    if memory(run, "parameters") > 0.75 * memory(ref, "parameters"):
        fail(rep, FSDP, f"with {flags(key)} every rank holds all the parameters: fully_shard each "
                 "block, then the whole model")
        return
    if layout == "offload" and key == ON_A_GPU:
        pins = standin.observed(run).get("offload", [])
        if pins and not all(p["pin_memory"] for p in pins):
            fail(rep, FSDP, "on a GPU (the check's stand-in) the offloaded shards are not in "
                     "pinned host memory, so every copy to the GPU waits: "
                     "CPUOffloadPolicy(pin_memory=torch.cuda.is_available())")
            return
    passed(ctx, FSDP, key)


def checkpointed_formula(run) -> float:
    """The formula's activations with every block checkpointed, for this run's shapes: the
    run's own formula, unless the run's blocks are not CheckpointWrapper's (the formula only
    knows that class: a module of the participant's own that calls torch.utils.checkpoint)."""
    rank0 = run.summary["memory"]["per_rank"][0]
    if rank0["layout"].get("checkpointing"):
        return formula(run, "activations")
    from utils.memory import Layout, predict  # (imports torch: only on this rare way)
    layout = Layout(**{**rank0["layout"], "checkpointing": True})
    cfg = types.SimpleNamespace(**run.summary["model_config"])
    return predict(cfg, tokens(run), layout, precision=run.summary.get("precision", "fp32")
                   )["activations"]


def check_checkpointing(ctx, key, run, ref) -> None:
    """Judged by the bytes measured against the formula's: no block checkpointed, each block,
    the whole model as one; whatever module does the checkpointing."""
    rep = ctx.report
    record = run.ranks[0]
    types = record.get("block_types", [])
    wrapped = [t for t in types if "CheckpointWrapper" in t]
    options = record.get("checkpoint_fns", [])
    saved, expected = memory(run, "activations"), checkpointed_formula(run)
    full = memory(ref, "activations") * tokens(run) / tokens(ref)
    if wrapped or saved < 0.9 * full or any("OffloadWrapper" in t for t in types):
        rep.attempt(CHECKPOINTING)
    accum = key[1]
    if accum > 1 and near(saved, accum * expected, 0.1):
        return  # every micro-batch's activations alive at once: check_accumulation's to say
    if any("OffloadWrapper" in t for t in types):
        fail(rep, CHECKPOINTING, f"with {flags(key)} the blocks are offload_wrapper's, which "
             "move their activations to host memory instead of recomputing them: "
             "checkpoint_wrapper(block) for every block of model.layers")
    elif near(saved, full, 0.02):
        fail(rep, CHECKPOINTING, f"with {flags(key)} the blocks still save all their activations: "
                 "replace every block of model.layers by checkpoint_wrapper(block)")
    elif saved < 0.7 * expected:
        fail(rep, CHECKPOINTING, f"with {flags(key)}: {saved} bytes of activations, fewer than the "
                 f"{expected:.0f} that checkpointing each block keeps: checkpoint each "
                 "Transformer block on its own, not the whole model (whose backward then "
                 "recomputes everything at once)")
    elif (saved > 1.3 * expected and wrapped and len(wrapped) == len(types)
          and "REENTRANT" in record.get("checkpoint_impls", [])):
        fail(rep, CHECKPOINTING, f"with {flags(key)}: {saved} bytes of activations, more than the "
                 f"{expected:.0f} of every block checkpointed, though every block is wrapped: "
                 "the reentrant checkpointing (deprecated) keeps more; use the default "
                 "(non-reentrant) checkpointing, checkpoint_wrapper(block) without "
                 "checkpoint_impl")
    elif (saved > 1.3 * expected and wrapped and len(wrapped) == len(types)
          and any(o["reentrant"] for o in options)):
        fail(rep, CHECKPOINTING, f"with {flags(key)}: {saved} bytes of activations, more than the "
                 f"{expected:.0f} of every block checkpointed, though every block is wrapped: "
                 "the checkpoint_fn given runs the reentrant checkpointing (use_reentrant "
                 "defaults to True), which keeps more: leave checkpoint_fn out, "
                 "checkpoint_wrapper(block)")
    elif saved > 1.3 * expected or 0 < len(wrapped) < len(types):
        fail(rep, CHECKPOINTING, f"with {flags(key)}: {saved} bytes of activations, more than the "
                 f"{expected:.0f} of every block checkpointed whole ({len(wrapped)} of "
                 f"{len(types)} blocks wrapped): wrap each block of model.layers, the whole "
                 "block")
    elif any(o["preserve_rng_state"] is False for o in options):
        # (the check trains without dropout, where it cannot show in the losses)
        fail(rep, CHECKPOINTING, f"with {flags(key)} the blocks are wrapped with "
             "preserve_rng_state=False: with dropout the recomputed forward draws other masks "
             "than the first, and backward gets gradients of another network: leave "
             "preserve_rng_state out, checkpoint_wrapper(block)")
    else:
        passed(ctx, CHECKPOINTING, key, f"{saved / full:.0%}")


def check_accumulation(ctx, key, run, ref, runs) -> None:
    """Once per step, not per micro-batch: DDP's all-reduces, FSDP's reduce-scatters."""
    rep = ctx.report
    layout = key[0]
    steps = run.summary["steps"] or 1
    calls = run.ranks[0].get("optimizer_calls") or {}
    if calls.get("steps", 0) > steps:
        fail(rep, ACCUMULATION, f"with {flags(key)} optimizer.step() ran {calls['steps']} times "
             f"in {steps} steps, once per micro-batch: step once per optimizer step, after the "
             "last micro-batch (after `if not last: continue`)")
        return
    # backward() calls before each step: the first step made early, the others after N
    counts = calls.get("backwards_per_step") or []
    early = len(counts) > 1 and counts[0] < key[1] and all(n == key[1] for n in counts[1:])
    if early and calls.get("discarding_zero_grads"):
        fail(rep, ACCUMULATION, f"with {flags(key)} the optimizer stepped after micro-batch "
             f"{counts[0]} of {key[1]}, and from then on each step's zero_grad() fell between "
             f"the micro-batches of a step ({calls['discarding_zero_grads']} times): the step's "
             "last micro-batch is mis-counted, last = micro % args.grad_accum == 0 right after "
             "micro += 1")
        return
    if early:
        fail(rep, ACCUMULATION, f"with {flags(key)} the first optimizer step came after "
             f"{counts[0]} micro-batch(es) instead of args.grad_accum = {key[1]} (the others "
             "after all of theirs): count the micro-batches from 0, micro = 0 before the loop")
        return
    if calls.get("discarding_zero_grads"):
        fail(rep, ACCUMULATION, f"with {flags(key)} optimizer.zero_grad() ran between the "
             f"micro-batches of a step ({calls['discarding_zero_grads']} times), throwing away "
             "the gradients added up so far: zero_grad once per optimizer step, before its "
             "first micro-batch (if micro % args.grad_accum == 0)")
        return
    if all_micro_batches_alive(key, run):
        fail(rep, ACCUMULATION, f"with {flags(key)} the activations of all {key[1]} "
             f"micro-batches are alive at once ({memory(run, 'activations')} bytes): call "
             "backward() on each micro-batch's loss right after its forward, so that its "
             "activations are freed before the next micro-batch")
        return
    counted, per_step, what = gradient_syncs(run, ref)
    if counted is None or not per_step:
        return
    said = (f"with {flags(key)} {what} {counted} times in {steps} steps ({counted / steps:g} per "
            f"step instead of {per_step:g})")
    # syncs per step beyond one: (micro-batches - 1) x per_step where no unit's sync is off
    extra = counted / steps - per_step
    if layout in FSDP_LAYOUTS and 0 < extra < (key[1] - 1) * per_step - 0.5:
        still = extra / (key[1] - 1)
        blocks = sum((run.ranks[0].get("fsdp") or {}).get("blocks", []))
        which = " (the blocks)" if near(still, blocks, 0.01) else ""
        fail(rep, ACCUMULATION, f"{said}: inside no_gradient_sync {still:g} of the "
             f"{per_step:g} FSDP units{which} still reduce-scatter, their sync left on: "
             "model.set_requires_gradient_sync(False) must reach every unit, so leave its "
             "recurse at the default, True")
        return
    if layout not in FSDP_LAYOUTS and counted > steps * per_step and \
            not calls.get("ddp_unsynced_backwards") and fsdp_syncs_once(runs, ref):
        fail(rep, ACCUMULATION, f"{said}, though the FSDP runs reduce-scatter once per step: "
             "DDP's sync was off in no backward, so no_gradient_sync's DDP branch never "
             "switches it off: no_sync() is a context manager, calling it does nothing; "
             "with model.no_sync(): yield")
        return
    if counted > steps * per_step:
        inside = ("its forward pass too (DDP decides in forward whether the backward "
                  "all-reduces)" if layout in ("ddp", "zero1") else "its backward too (FSDP2 "
                  "reduce-scatters in backward unless the sync is off)")
        fail(rep, ACCUMULATION, f"{said}, once per micro-batch: run all but the last "
             f"micro-batch inside no_gradient_sync(model), {inside}")
    else:
        passed(ctx, ACCUMULATION, key)


def fsdp_syncs_once(runs: dict, ref) -> bool:
    """Some FSDP run with accumulation reduce-scatters exactly once per step (no_gradient_sync
    and the loop's use of it work there)."""
    for key, run in runs.items():
        if key[0] in FSDP_LAYOUTS and key[1] > 1:
            counted, per_step, _ = gradient_syncs(run, ref)
            if counted is not None and per_step and counted == run.summary["steps"] * per_step:
                return True
    return False


def all_micro_batches_alive(key, run) -> bool:
    """The run's activations are those of all its micro-batches at once, not one's (their
    losses added up and one backward at the end)."""
    layout, accum, ckpt = key
    one = checkpointed_formula(run) if ckpt else formula(run, "activations")
    saved = memory(run, "activations")
    return accum > 1 and (near(saved, accum * one, 0.1) if ckpt else saved > 1.5 * one)


def gradient_syncs(run, ref) -> tuple[int | None, float, str]:
    """(times the run synchronised its gradients, how often per step it should, what it did):
    DDP's all-reduces against the single process's per step; FSDP's reduce-scatters, one per
    FSDP unit per step."""
    if run.summary["args"].get("layout") in ("ddp", "zero1"):
        per_step = ref.ranks[0].get("allreduces", 0) / max(ref.summary["steps"], 1)
        return run.ranks[0].get("allreduces"), per_step, "DDP all-reduced the gradients"
    units = run.ranks[0].get("fsdp") or {}
    per_step = sum(units.get("blocks", [])) + bool(units.get("root")) + len(units.get("inner", []))
    # (counted where the check asks: COUNT; none made, none counted)
    return run.ranks[0].get("reduce_scatters", 0), per_step, "FSDP reduce-scattered the gradients"


def check_same_models_sharded(ctx, runs: dict) -> None:
    """The FSDP layouts shard each rank's own model (DDP broadcasts rank 0's): every rank must
    build it with the same initial weights."""
    for key, run in runs.items():
        other = rank_with_other_initial_weights(run) if key[0] in FSDP_LAYOUTS else None
        if other is not None:
            fail(ctx.report, FSDP, f"with {flags(key)} rank {other} built the model with other "
                 "initial weights than rank 0, and fully_shard keeps each rank's share of its "
                 "own model (DDP broadcasts rank 0's weights; FSDP does not), so the sharded "
                 f"model is a mix of two: {SEED_ALIKE}")
            return


def check_too_few_syncs(ctx, runs: dict, ref) -> None:
    """Gradients synchronised less than once per step (the last micro-batch of a step inside
    no_gradient_sync too): the ranks train apart, in every run so affected, whatever its other
    options; said once, under TODO 58, before the losses are compared."""
    fewer = {}
    for key, run in runs.items():
        counted, per_step, what = gradient_syncs(run, ref)
        steps = run.summary["steps"]
        if counted is not None and per_step and steps and counted < steps * per_step:
            fewer[key] = (counted, steps, what)
    if not fewer:
        return
    key, (counted, steps, what) = next(iter(fewer.items()))
    said = f"with {flags(key)} {what} {counted} times in {steps} steps, fewer than once per step"
    if all(k[0] in FSDP_LAYOUTS for k in fewer) and any(k[0] not in FSDP_LAYOUTS for k in runs):
        fail(ctx.report, ACCUMULATION, f"{said} (DDP's runs all-reduce every step): "
             "no_gradient_sync must switch FSDP's gradient sync back on as it ends, "
             "model.set_requires_gradient_sync(True) after the yield (in a finally), and the "
             "last micro-batch of each step runs outside it")
    else:
        fail(ctx.report, ACCUMULATION, f"{said}, so the ranks train apart: the last micro-batch "
             "of every step outside no_gradient_sync(model), contextlib.nullcontext() if last "
             "(last = micro % args.grad_accum == 0)")


HINTS = {
    55: ("Activation checkpointing trades compute for memory: a checkpointed block keeps only "
         "its input and runs its forward again during backward. Per block, so backward "
         "recomputes one block at a time.",
         "checkpoint_wrapper from torch.distributed.algorithms._checkpoint.checkpoint_wrapper, "
         "applied to every block of model.layers (an nn.ModuleDict: put each wrapped block back "
         "under its name), in apply_activation_checkpointing."),
    56: ("FSDP2 shards parameters, gradients and optimizer state (ZeRO-3). Whether a block frees "
         "its gathered weights after forward decides between zero3 (free, gather again for "
         "backward) and zero2 (keep them); offload moves the shards to host memory.",
         "fully_shard from torch.distributed.fsdp in apply_fsdp, on every block and then on the "
         "root, as in the FSDP step; its reshard_after_forward argument tells zero2 from zero3, "
         "its offload_policy (CPUOffloadPolicy(pin_memory=torch.cuda.is_available()): pinning "
         "needs a GPU) on every unit, blocks and root, makes offload."),
    57: ("ZeRO-1 shards the optimizer state: each rank keeps AdamW's two moments for its own "
         "share of the parameters, updates that share, and broadcasts it to the others.",
         "torch.distributed.optim.ZeroRedundancyOptimizer, where the optimizer is made, for "
         "--layout zero1 only: it takes the parameters, the optimizer class to shard "
         "(optimizer_class) and that class's own arguments."),
    58: ("A step of N micro-batches must give the gradient of the whole batch: backward() adds "
         "up gradients, so each micro-batch's loss counts 1/N. And the ranks should average "
         "their gradients once per step, after the last micro-batch, not after every one.",
         "In the training loop: divide the loss by args.grad_accum; the script's "
         "no_gradient_sync(model) context (DDP's no_sync, FSDP2's set_requires_gradient_sync) "
         "around every micro-batch but the last, its forward pass and backward both; "
         "contextlib.nullcontext() for the last one."),
}
