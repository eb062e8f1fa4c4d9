"""Step 1, train/to_distributed_training.py (TODOs 1-11): DDP.

Your script runs as two nodes with one process each (as on a cluster: LOCAL_RANK is 0 on both,
so a local rank used where the global rank belongs shows), next to the solution in one process
with the same global batch. Dropout is off: every loss, evaluation and weight must agree.
"""

from __future__ import annotations

import ast
import copy
import itertools
import re

from selfcheck import standin
from selfcheck.compare import first_difference, near
from selfcheck.failures import rank_failure
from selfcheck.runs import ONE, TWO_NODES, Geometry, Run
from selfcheck.steps.common import (SEQ_LEN, calls, check_eval_exact, check_eval_reads,
                                    check_imports, check_losses, check_new_order,
                                    check_prints_once, check_tokens, check_training_shards,
                                    check_weights_file, crash_todo, epoch_passes, flow_todos,
                                    printed_by_others, printed_losses, report_crash,
                                    train_sampler)

FILE = "train/to_distributed_training.py"
WHAT = "DDP: samplers, DDP wrapper, reductions, rank 0 output"
TODOS = {1: "imports", 2: "setup", 3: "samplers", 4: "DataLoaders", 5: "DDP",
         6: "set_epoch", 7: "loss over ranks", 8: "evaluation over ranks", 9: "print0",
         10: "save0", 11: "destroy_process_group"}
BATCH = 4
# helpers whose TODO is clear wherever a crash or a hang meets them
CALL_TODO = {"setup": 2, "set_epoch": 6, "save0": 10, "destroy_process_group": 11}
# the sums over ranks the script makes (collectives: every rank must call them)
REDUCERS = ("all_reduce_sum", "all_reduce_mean", "dist.all_reduce")
# dataset index (the order the script builds them) -> (name, dataset variable, sampler variable)
SPLITS = {0: ("training", "train_ds", "train_sampler"), 1: ("validation", "val_ds", "val_sampler"),
          2: ("test", "test_ds", "test_sampler")}


def check(ctx) -> None:
    rep = ctx.report
    ctx.extra["call_todo"] = CALL_TODO
    ref = Run(ctx.work, "reference", ctx.root / "solutions" / FILE, BATCH * 2, geometry=ONE,
              reference=True)
    run = Run(ctx.work, "yours", ctx.script, BATCH, geometry=TWO_NODES, eval_probe=True)
    # two nodes of two GPUs each, stand-ins (selfcheck/standin.py): the script's cuda branches
    gpu = Run(ctx.work, "stand-in-gpus", ctx.script, BATCH, geometry=Geometry(2, 2), gpu=True,
              extra=["--max-steps", "2"])
    ref.wait(), run.wait(), gpu.wait()
    if ref.crashed:
        raise RuntimeError(f"the reference run failed: {ref.failure and ref.failure.message}")
    records = [r for r in run.ranks if r]
    if run.crashed:
        one_sided = one_sided_collective(run)
        swapped = swapped_sampler_arguments(run)
        if one_sided:
            rep.fail(*one_sided)
            rep.attempt(one_sided[0])
        elif swapped:
            rep.fail(3, swapped)
            rep.attempt(3)
        elif wrong_world_size(run) and "Invalid rank" in (run.failure.message or ""):
            pass  # a sampler told of 1 replica on rank 1: TODO 2's world_size (check_setup)
        elif run.failure and run.failure.callee in ("all_reduce_mean", "all_reduce_sum") and \
                "object has no attribute" in (run.failure.message or ""):
            name = run.failure.callee
            report_crash(ctx, run, cause=(
                f"{name}'s second argument is a process group (the ranks to reduce over), not "
                f"a count: leave it out, {name}(tensor) reduces over all ranks"))
        elif eval_sampler_trains(run):
            report_crash(ctx, run, todo=3, cause=(
                "the training sampler is a DistributedEvalSampler, which neither shuffles nor "
                "takes an epoch: training takes torch's DistributedSampler(train_ds, ..., "
                "shuffle=True, seed=args.seed, drop_last=True)"))
        elif averaged_before_backward(run):
            report_crash(ctx, run, todo=7, cause=(
                "backward got the averaged loss: all_reduce_mean returns a copy without "
                "gradient, for the log only; backward takes the rank's own loss (DDP averages "
                "the gradients), step_loss = all_reduce_mean(loss.detach())"))
        elif "'DistributedDataParallel' object has no attribute" in (
                run.failure.message if run.failure else ""):
            rep.attempt(5)  # (the DDP line may have left TODO 5's place: it is there all the same)
            report_crash(ctx, run, todo=5, cause=(
                "the model is wrapped in DDP before this line, which uses the model's own "
                "methods: the wrapper forwards model(x), parameters() and state_dict(), not the "
                "rest; wrap it where TODO 5 says, after the lines that use the model itself "
                "(or call them on model.module)"))
        elif collective_after_destroy(run):
            report_crash(ctx, run, todo=11, cause=(
                "a collective after destroy_process_group(): the process group is gone by "
                "then; destroy it last, after every collective, barrier and monitor.close"))
        elif loss_made_a_number(ctx, run.failure):
            report_crash(ctx, run, todo=7, cause=(
                "step_loss must stay a tensor (loss_history and monitor.report take it as one; "
                ".item() would also wait for the GPU at every step): drop .item(), "
                "step_loss = all_reduce_mean(loss.detach())"))
        else:
            report_crash(ctx, run)
        rep.note(f"(full output: {run.dir / 'output.txt'})")
    if not records:
        return
    r0 = records[0]
    check_setup(ctx, run)
    eval_sharded, shards_right, other_order = False, True, False
    if len(records) == 2 and records[1].get("datasets"):
        if check_set_epoch_alike(ctx, run):  # (then the shards overlap: TODO 6's, not 3's)
            other_order = True
            rep.ok(4, "the training DataLoader takes its batches from the sampler")
        else:
            shards_right = check_training_shards(ctx, run, 3, 4, replicas=2,
                                                 replica_of=lambda r: r)
        shards_right = check_batch_size(ctx, run) and shards_right
        check_sampler_datasets(ctx, run)
        eval_sharded = all(check_eval_reads(ctx, run, 3, replicas=2, replica_of=lambda r: r,
                                            todo_loader=4, split=split) for split in (1, 2))
        check_new_order(ctx, run, 6, 3)
        other_order = check_set_epoch_once(ctx, run) or other_order
    check_ddp(ctx, run, ref)
    check_ddp_on_gpus(ctx, run, gpu)
    if run.crashed:
        check_imports(ctx, 1, run) if not rep.failed(1) else None
        return
    check_imports(ctx, 1, run)
    # another order of the later epochs than the single-process run's (TODO 6): only the first
    # epoch's losses can match it, and no saved weights
    epoch_steps = len(epoch_passes(r0, 0)[0]) // BATCH if rep.failed(6) and epoch_passes(
        r0, 0) else None
    discarded = discarded_results(ctx, run)
    other_data = ("once each rank trains on its own shard (TODO 3 and 4): until then the "
                  "ranks train on other data than one process")
    one_model = (f"once the ranks train one model (TODO {1 if rep.failed(1) else 5}'s FIX): "
                 "until then each rank has weights of its own")
    if not shards_right:
        rep.waits(7, f"the logged losses are compared with one process's {other_data}")
    elif other_order:
        rep.waits(7, "the logged losses are compared with the single-process run's once "
                  "TODO 6 gives every epoch its order")
    elif epoch_steps and first_difference(run.summary["loss_history"][:epoch_steps],
                                        ref.summary["loss_history"][:epoch_steps]) is None:
        rep.ok(7, f"the logged losses of the first epoch equal the single-process run "
               f"({epoch_steps} steps; the later epochs once TODO 6 gives them their order)")
    elif ctx.extra.get("ddp_drift"):
        rep.waits(7, f"the logged losses are compared with one process's {one_model}")
    elif averaged_for_print_only(run, ref):
        rep.fail(7, "the step lines print the mean over the ranks, but loss_history (the "
                 "epoch's train loss, summary.json) gets rank 0's own loss: average before "
                 "appending, step_loss = all_reduce_mean(loss.detach())")
    elif check_losses(ctx, run, ref, 7):
        if check_loss_on_four_ranks(ctx, run, gpu):
            check_tokens(ctx, run, 7, BATCH * 2 * SEQ_LEN,
                         "throughput.step(x.numel() * world_size)")
    elif discarded.get("main"):
        name, where = discarded["main"]
        rep.fail(7, f"{name} returns the mean as a new tensor and leaves its argument alone: "
                 f"{where}; step_loss = all_reduce_mean(loss.detach())")
    elif near(r0["param_sum"], ref.ranks[0]["param_sum"], 1e-5):
        mine, theirs = run.summary["loss_history"], ref.summary["loss_history"]
        pairs = list(zip(mine, theirs))
        # rank 0's own loss lies above the mean at some steps, below it at others; the
        # maximum over the ranks lies above it at every step, the minimum below
        side = ("maximum" if all(m > t for m, t in pairs) else "minimum"
                if all(m < t for m, t in pairs) else None) if len(pairs) >= 5 else None
        rep.fail(7, "the weights match the single-process run, so training is right, but the "
                 + (f"logged loss is {'above' if side == 'maximum' else 'below'} one "
                    f"process's at every step, the {side} over the "
                    f"ranks (ReduceOp.{side[:3].upper()}): the mean, " if side else
                    "logged loss is rank 0's own: ") + "step_loss = all_reduce_mean(loss.detach())")
    if any(c["func"] == "evaluate" for c in calls(run, "all_reduce_sum") + calls(
            run, "dist.all_reduce") + calls(run, "all_reduce_mean")):
        rep.attempt(8)
    eval_loaders = [l for l in r0.get("loaders", []) if l["dataset"] in (1, 2)]
    outside = reduced_outside_evaluate(run, ctx.text)
    inside = reduced_in_eval_loop(ctx.text)
    if outside:  # (TODO 8's lines may be as shipped: what was tried is named all the same)
        rep.attempt(8)
    if eval_sharded and ctx.extra.get("ddp_drift"):
        rep.waits(8, f"evaluate() is compared with one process's {one_model}")
    elif eval_sharded and outside and not any(c["func"] == "evaluate" for c in calls(
            run, "all_reduce_sum")):
        rep.fail(8, f"evaluate()'s result is averaged over the ranks where it is called (line "
                 f"{outside}): a mean of the ranks' means weighs their shards alike though they "
                 "differ in size, and the loss that is not averaged there stays rank 0's own; add "
                 "up loss_sum and tokens over the ranks inside evaluate(), all_reduce_sum, "
                 "before dividing")
    elif eval_sharded and inside:
        check_eval_exact(ctx, run, 8, f"the sums are added up over the ranks inside the batch "
                         f"loop (line {inside}), so each batch adds the totals so far once more: "
                         "once, after the loop, loss_sum, tokens = all_reduce_sum(loss_sum), "
                         "all_reduce_sum(tokens)")
    elif eval_sharded:
        hint = ("add up loss_sum and tokens over the ranks (all_reduce_sum) before dividing"
                if "evaluate" not in discarded else
                f"{discarded['evaluate'][0]} returns the sum as a new tensor and leaves its "
                f"argument alone, and {discarded['evaluate'][1]}: "
                "loss_sum, tokens = all_reduce_sum(loss_sum), all_reduce_sum(tokens)")
        check_eval_exact(ctx, run, 8, hint)
    elif rep.judged(8):
        pass
    elif eval_loaders and all(l["sampler"] is not None for l in eval_loaders):
        # the ranks share the evaluation, but not every sample once (a FIX of TODO 3 or 4)
        rep.waits(8, "evaluate() is compared with the whole split once evaluation reads every "
                  "sample once")
    else:  # each rank evaluated everything: nothing to add up yet
        rep.fail(8, "the ranks do not share the evaluation yet (TODO 3's evaluation samplers): "
                 "then add up loss_sum and tokens over the ranks before dividing")
    # a process group destroyed early (TODO 11): after it every rank counts as rank 0, so
    # print0 and save0 run everywhere; TODO 9 and 10 are judged on what came before it
    late = after_destroy(run)
    if late:
        run = before_destroy(run)
    check_prints_once(ctx, run, 9)
    scaled = (shards_right and not other_order and not ctx.extra.get("ddp_drift")
              and check_gradient_scale(ctx, run, ref))
    if not shards_right:
        rep.waits(10, f"the saved weights are compared with one process's {other_data}")
    elif scaled:
        rep.waits(10, "the saved weights are compared with one process's once backward gets "
                  "one process's gradients (TODO 5's FIX)")
    elif ctx.extra.get("ddp_drift"):
        rep.waits(10, f"the saved weights are compared with one process's {one_model}")
    elif epoch_steps and not any(s for r in run.ranks[1:] if r for s in r.get("saves", [])):
        rep.waits(10, "the saved weights are compared once TODO 6 gives every epoch the "
                  "single-process run's order")
    else:
        check_saves(ctx, run, ref)
    check_teardown(ctx, run, late)


def after_destroy(run) -> dict | None:
    """The first print or save of a rank other than 0 after its process group was destroyed
    (print0 and save0 then take every rank for rank 0), with what it was."""
    for rank, record in enumerate(run.ranks):
        if not record or not rank or "destroyed_at" not in record:
            continue
        at = record["destroyed_at"]
        late = [p for p in printed_by_others(run) if p in record.get("prints", [])
                and p.get("t", 0) > at] + [s for s in record.get("saves", [])
                                             if s.get("t", 0) > at]
        if late:
            first = min(late, key=lambda e: e["t"])
            what = (f"prints line {first['line']}" if "text" in first else
                    f"writes {first['path'].rsplit('/', 1)[-1]} (line {first['line']})")
            return {"rank": rank, "what": what}
    return None


def before_destroy(run):
    """The run as it was until each rank destroyed its process group: its prints and saves."""
    view = copy.copy(run)
    view.ranks = [record if not record or "destroyed_at" not in record else dict(
        record, **{key: [e for e in record.get(key, []) if e.get("t", 0) <= record[
            "destroyed_at"]] for key in ("prints", "saves")}) for record in run.ranks]
    return view


def averaged_for_print_only(run, ref) -> bool:
    """The printed step losses are the single-process run's (the mean over the ranks), the
    loss history is not: the mean was taken for the print alone."""
    mine, theirs = run.summary["loss_history"], ref.summary["loss_history"]
    if len(mine) != len(theirs) or first_difference(mine, theirs) is None:
        return False
    printed = {s: v for s, v in printed_losses(run.outputs[0]).items() if 1 <= s <= len(theirs)}
    return bool(printed) and all(near(v, theirs[s - 1], 1e-3, 1e-3) for s, v in printed.items())


def discarded_results(ctx, run) -> dict:
    """{function: (helper, its lines)} where the script calls all_reduce_sum or all_reduce_mean
    as a statement of its own: they return the result, a new tensor, and leave the argument
    alone. The lines as words: "line 196 throws it away", "lines 196 and 197 throw them away"."""
    lines = {c["line"]: (c["name"], c["func"]) for name in ("all_reduce_sum", "all_reduce_mean")
             for c in calls(run, name) if c.get("direct")}
    try:
        tree = ast.parse(ctx.text)
    except SyntaxError:
        return {}
    found = {}
    for node in ast.walk(tree):
        # (the call itself a statement: a call nested in another call hands its result on)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and getattr(
                node.value.func, "id", getattr(node.value.func, "attr", None)) in (
                "all_reduce_sum", "all_reduce_mean"):
            for line in range(node.lineno, (node.end_lineno or node.lineno) + 1):
                if line in lines:
                    name, func = lines[line]
                    found.setdefault(func, (name, []))[1].append(node.lineno)
                    break
    return {func: (name, throw_away(sorted(set(where)))) for func, (name, where) in found.items()}


def throw_away(lines: list[int]) -> str:
    """'line 196 throws it away', 'lines 196 and 197 throw them away'."""
    if len(lines) == 1:
        return f"line {lines[0]} throws it away"
    return f"lines {', '.join(map(str, lines[:-1]))} and {lines[-1]} throw them away"


def one_sided_collective(run) -> tuple[int, str] | None:
    """(TODO, text) for a run that stopped because one rank summed over the ranks where another
    never did: it waits in all_reduce_sum or all_reduce_mean (or failed there when the other
    left), and the other finished, or stopped somewhere else (a `val_loss` left nan on the rank
    that did not evaluate). In evaluate() that is TODO 8's; in the training loop TODO 7's."""
    f = run.failure
    if f is None:
        return None
    seqs = {r: [(c["name"], c["func"], c["line"]) for c in rec.get("calls", [])
                if c["name"] in REDUCERS] for r, rec in enumerate(run.ranks) if rec}
    waiting, other = None, None
    hung_in_sum = f.callee in ("all_reduce_sum", "all_reduce_mean", "all_reduce")
    if f.kind in ("hung", "timeout") and hung_in_sum and f.rank not in seqs:  # (no record)
        waiting = (f.rank, f.callee, f.func, f.line)
        finished = [r for r, e in run.ended.items() if e == "exit 0" and r != f.rank]
        other = f"rank {finished[0]} never joins it (it had finished)" if finished else \
            "another rank never joins it"
    else:  # a rank made a sum more than another, which did not stop of an error of its own
        # in that function (a lost connection is news about the other rank)
        stops = {r: rank_failure(run, r) for r in seqs}
        for (long, seq), (short, mine) in itertools.permutations(seqs.items(), 2):
            if len(seq) <= len(mine) or [s[:2] for s in seq[:len(mine)]] != [s[:2] for s in mine]:
                continue
            name, func, line = seq[len(mine)]
            stop = stops[short]
            if stop is None:
                other = f"rank {short} never joins it (it finished)"
            elif stop.peer or func not in {fr.get("func") for fr in stop.frames}:
                said = f": {stop.message}" if len(stop.message or "") in range(1, 100) else ""
                other = (f"rank {short} never joins it (it went on to line {stop.line})"
                         if stop.peer else
                         f"rank {short} never joins it (it stopped at line {stop.line}{said})")
            else:
                continue
            waiting = (long, name, func, line)
            break
    if waiting is None:
        return None
    rank, name, func, line = waiting
    if func == "evaluate":
        return 8, (f"rank {rank} sums in evaluate() (line {line}, {name}) and {other}: every "
                   "rank must call evaluate(), its sums over the ranks are collectives (no `if "
                   "rank == 0:` around it; print0 prints the result once)")
    return 7, (f"rank {rank} waits in {name} (line {line}) and {other}: every rank must call it, "
               "it is a collective: step_loss = all_reduce_mean(loss.detach()) on every rank, "
               "outside any `if rank == 0:` (print0 prints it once)")


REDUCTIONS = ("all_reduce_sum", "all_reduce_mean", "all_reduce")


def reduced_outside_evaluate(run, text: str) -> int | None:
    """The line of main() where an evaluation's result goes into a reduction
    (val_loss = all_reduce_mean(torch.tensor(evaluate(...))))."""
    lines = text.splitlines()
    for c in calls(run, "all_reduce_mean") + calls(run, "all_reduce_sum") + calls(
            run, "dist.all_reduce"):
        line = c["line"]
        if c["func"] == "main" and line and line <= len(lines) and "evaluate(" in lines[line - 1]:
            return line
    return None


def reduced_in_eval_loop(text: str) -> int | None:
    """The line of a reduction inside evaluate()'s batch loop, if any."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and fn.name == "evaluate":
            for loop in ast.walk(fn):
                if isinstance(loop, ast.For):
                    for node in ast.walk(loop):
                        name = getattr(getattr(node, "func", None), "id", None) or getattr(
                            getattr(node, "func", None), "attr", None)
                        if isinstance(node, ast.Call) and name in REDUCTIONS:
                            return node.lineno
    return None


def collective_after_destroy(run) -> bool:
    """The run stopped on a missing process group after the script had destroyed it."""
    message = run.failure.message if run.failure else ""
    return "process group has not been initialized" in message and any(
        "destroyed_at" in (r or {}) for r in run.ranks)


def loss_made_a_number(ctx, f) -> bool:
    """A crash on a Python float where a tensor was expected, on a line that uses the
    step_loss TODO 7 made (step_loss = all_reduce_mean(...).item()), or stacks a loss_history
    that got floats (loss_history.append(step_loss.item()))."""
    if f is None or not re.search(r"'float' object has no attribute|expected Tensor as element "
                                  r"\d+ .*but got float", f.message or ""):
        return False
    lines = ctx.text.splitlines()
    stacked = f.line and f.line <= len(lines) and "loss_history" in lines[f.line - 1]
    return "step_loss" in flow_todos(ctx, f.line).get(7, "") or bool(
        stacked and re.search(r"loss_history\.append\(.*\.item\(\)", ctx.text))


def eval_sampler_trains(run) -> bool:
    """The training DataLoader's sampler is a DistributedEvalSampler, and set_epoch stopped
    the run on it (set_epoch on the validation sampler stops it the same way: TODO 6)."""
    message = run.failure.message if run.failure else ""
    sampler = train_sampler(run.ranks[0] or {}) or {}
    return "'DistributedEvalSampler' object has no attribute 'set_epoch'" in message and \
        sampler.get("kind") == "DistributedEvalSampler"


def averaged_before_backward(run) -> bool:
    """backward stopped on a loss without gradient after all_reduce_mean had run: the loss
    was averaged over the ranks (a copy for the log) before backward, not after."""
    message = run.failure.message if run.failure else ""
    return "does not require grad" in message and bool(calls(run, "all_reduce_mean"))


def swapped_sampler_arguments(run) -> str | None:
    """A sampler given rank and world_size in each other's places (positionally: the order is
    dataset, num_replicas, rank): rank 0 then has 0 replicas and stops dividing by it."""
    world = run.geometry.world
    for rank, record in enumerate(run.ranks):
        for s in (record or {}).get("samplers", []):
            given = s["given"]
            if given.get("num_replicas") == rank != world and given.get("rank") == world:
                return (f"{s['kind']}(dataset, num_replicas, rank) takes the count first: "
                        f"rank {rank} got num_replicas={rank}, rank={world} (line {s['line']}); "
                        "pass them as keywords, num_replicas=world_size, rank=rank")
    return None


def check_sampler_datasets(ctx, run) -> None:
    """Every DataLoader's sampler was built over that loader's own dataset (a copied line
    gives the test loader the validation set's sampler, or the test sampler the validation
    set: with more test than validation samples some would never be read)."""
    rep = ctx.report
    record = run.ranks[0]
    loaders = record.get("loaders", [])
    for loader in loaders:
        i, ds = loader["sampler"], loader["dataset"]
        if i is None or ds not in SPLITS:
            continue
        built_over = record["samplers"][i]["dataset"]
        if built_over == ds or built_over not in SPLITS:
            continue
        name, var, sampler = SPLITS[ds]
        if sum(l["sampler"] == i for l in loaders) > 1:
            rep.fail(4, f"the {name} DataLoader (line {loader['line']}) gets the "
                     f"{SPLITS[built_over][0]} sampler: DataLoader({var}, sampler={sampler}, ...)")
        else:
            rep.fail(3, f"the sampler of the {name} DataLoader is built over the "
                     f"{SPLITS[built_over][0]} set (line {record['samplers'][i]['line']}): "
                     f"{sampler} = DistributedEvalSampler({var}, num_replicas=world_size, "
                     "rank=rank)" if ds else f"{sampler} = DistributedSampler({var}, ...)")
        return
    sampler = train_sampler(record)
    if sampler and sampler["kind"] == "DistributedSampler" and not rep.failed(3) and \
            sampler["given"].get("drop_last") is not True:
        rep.fail(3, "the training sampler has drop_last=False: where the samples do not divide "
                 "by the ranks it pads the last shard with repeated samples, DistributedSampler("
                 "train_ds, ..., drop_last=True)")


def check_set_epoch_alike(ctx, run) -> bool:
    """Every rank gives set_epoch the same epoch: the ranks' permutations are one, cut into
    shards. With another number per rank (set_epoch(epoch + rank)) each rank draws its own
    permutation, and the shards overlap. True where reported."""
    given = []
    for record in run.ranks[:2]:
        sampler = train_sampler(record or {})
        if sampler is None:
            return False
        index = record["samplers"].index(sampler)
        given.append([e for i, e in record.get("set_epoch", []) if i == index])
    if not all(given) or given[0] == given[1]:
        return False
    epoch = next(n for n, (a, b) in enumerate(zip(*given)) if a != b)
    ctx.report.fail(6, f"in epoch {epoch} rank 1 calls set_epoch({given[1][epoch]}) where rank 0 "
                    f"calls set_epoch({given[0][epoch]}): each rank then shuffles its own way "
                    "and the shards overlap; every rank gives the epoch itself, "
                    "train_sampler.set_epoch(epoch)")
    return True


def check_batch_size(ctx, run) -> bool:
    """The training DataLoader takes --batch-size as it is: the batch per rank (the global batch
    is batch_size x world_size). False where reported."""
    loaders = [l for l in (run.ranks[0] or {}).get("loaders", []) if l["dataset"] == 0]
    right = not (loaders and isinstance(loaders[0]["batch_size"], int)
                 and loaders[0]["batch_size"] != BATCH)
    if not right:
        ctx.report.fail(4, f"the training DataLoader takes batch_size={loaders[0]['batch_size']} "
                        f"where the run asks for --batch-size {BATCH}: --batch-size is per rank "
                        "(the global batch is args.batch_size x world_size), loader_args = "
                        "dict(batch_size=args.batch_size, ...)")
    return right


def check_set_epoch_once(ctx, run) -> bool:
    """set_epoch gets each epoch's number once, before the epoch's batches: called in the batch
    loop it reorders the rest of the epoch (the DataLoader already drew it) and the next.
    True where it gets other numbers (set_epoch(epoch + 1)): no epoch has the single-process
    run's order."""
    rep = ctx.report
    record = run.ranks[0]
    sampler = train_sampler(record)
    passes = epoch_passes(record, 0)
    if sampler is None:
        return False
    index = record["samplers"].index(sampler)
    values = [e for i, e in record.get("set_epoch", []) if i == index]
    if rep.failed(6):  # (said already): whether the epochs still read another order than one
        return bool(values) and values != list(range(len(values)))  # process's from the first
    shown = ", ".join(map(str, values[:4])) + (", ..." if len(values) > 4 else "")
    if len(values) > len(passes):
        rep.fail(6, f"set_epoch is called {len(values)} times in {len(passes)} epochs (with "
                 f"{shown}): once per epoch, before its batches, train_sampler.set_epoch(epoch)")
    elif values and values != list(range(len(values))):
        # another number than the epoch's: another order than the single-process run's from
        # the first epoch on, so losses and weights can only be compared once it is right
        epochs = ", ".join(map(str, range(min(len(values), 4)))) + (", ..." if len(
            values) > 4 else "")
        rep.fail(6, f"set_epoch gets {shown} in epochs {epochs}: give it the epoch that "
                 "starts, train_sampler.set_epoch(epoch), so every epoch reads the "
                 "single-process run's order")
        return True
    return False


def check_setup(ctx, run) -> None:
    rep = ctx.report
    records = [r for r in run.ranks if r]
    if any(r.get("setup") for r in records):
        rep.attempt(2)
    world = run.summary["world_size"] if run.summary else None
    # the script's own rank and world_size variables, seen where it built its samplers
    seen = [(r["rank"], s["locals"]) for r in records for s in r.get("samplers", [])]
    swapped = [(true, loc) for true, loc in seen if loc.get("rank", true) != true]
    worlds = {loc["world_size"] for _, loc in seen if "world_size" in loc}
    if world is not None:
        worlds.add(world)
    if not any(r.get("setup") for r in records):
        if not rep.failed(2):
            rep.fail(2, "setup() is never called: local_rank, rank, device, world_size = "
                     "setup(args.seed, args.device)")
    elif swapped:
        true, loc = swapped[0]
        again = assigned_after_setup(ctx, "rank")
        if again:
            line, code = again
            rep.fail(2, f"on rank {true} the variable rank is {loc['rank']}: line {line} sets it "
                     f"again after setup(), `{code}`; delete it, setup() gives each process "
                     "its global rank (under torchrun a Slurm task starts a node's processes, so "
                     "SLURM_PROCID is the node's number, not the process's)")
        else:
            rep.fail(2, f"on rank {true} the variable rank is {loc['rank']}: setup returns "
                     "local_rank, rank, device, world_size, in that order")
    elif worlds - {run.geometry.world}:
        reset = assigned_after_setup(ctx, "world_size", number=True)
        if reset:
            line, code = reset
            rep.fail(2, f"world_size is still {min(worlds - {run.geometry.world})} after "
                     f"setup(): delete the line `{code}` (line {line})")
        else:
            rep.fail(2, f"world_size is {min(worlds - {run.geometry.world})} in a run of "
                     f"{run.geometry.world} processes: take world_size from setup()")
    elif (again := assigned_after_setup(ctx, "device")) is not None:
        # the shipped line left below setup(): on a GPU node it takes cuda, the current GPU,
        # not the one setup() chose by name; TODO 2 replaces it
        ctx.extra["device_again"] = True
        rep.fail(2, f"line {again[0]} makes the device again after setup(), `{again[1]}`: "
                 "delete it, setup() returns this process's device (its GPU, or the CPU that "
                 "--device asks for)")
    elif any(r.get("setup") and "returned" in r["setup"][-1] for r in records):
        rep.ok(2, f"{run.geometry.world} ranks joined one process group")


def wrong_world_size(run) -> bool:
    """The script's world_size, where it built its samplers, is not the run's number of
    processes (a sampler on rank 1 of "1 replica" then stops the run: TODO 2's, not 3's)."""
    return any(s["locals"].get("world_size", run.geometry.world) != run.geometry.world
               for r in run.ranks if r for s in r.get("samplers", []))


def assigned_after_setup(ctx, name: str, number: bool = False) -> tuple[int, str] | None:
    """(line, code) of the first assignment to `name` alone after the setup() call that returned
    it (rank = int(os.environ["SLURM_PROCID"]) below the setup line); number: only a number
    assigned (the shipped `world_size = 1` left there)."""
    try:
        tree = ast.parse(ctx.text)
    except SyntaxError:
        return None
    for function in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        assigns = [n for n in ast.walk(function) if isinstance(n, ast.Assign)]
        setups = [n.lineno for n in assigns if isinstance(n.value, ast.Call) and getattr(
            n.value.func, "id", getattr(n.value.func, "attr", None)) == "setup"]
        for node in sorted(assigns, key=lambda n: n.lineno):
            if setups and node.lineno > min(setups) and any(
                    getattr(t, "id", None) == name for t in node.targets) and (
                    not number or isinstance(node.value, ast.Constant)):
                return node.lineno, ast.get_source_segment(ctx.text, node) or name
    return None


def check_ddp(ctx, run, ref) -> None:
    rep = ctx.report
    records = [r for r in run.ranks if r]
    ddp = [d for r in records for d in r.get("ddp", [])]
    if ddp:
        rep.attempt(5)
    if rep.failed(5) or len(records) < 2 or any("param_sum" not in r for r in records[:2]):
        return
    same = records[0]["param_sum"] == records[1]["param_sum"]
    twice = next((d for d in ddp if d["module"] == "DistributedDataParallel"), None)
    if twice:  # the numbers stay right (the mean of means): only the time is lost
        rep.fail(5, f"the model is wrapped in DDP twice (line {twice['line']} wraps a DDP): "
                 "every gradient is all-reduced twice per step; wrap the model once, model = "
                 "DDP(model, device_ids=...)")
    elif same and ddp:
        rep.ok(5, "both ranks end with the same weights")
    elif same:  # no DDP, yet equal weights: nothing was trained apart (or a crash)
        if not run.crashed:
            rep.fail(5, "the model is not wrapped in DDP: model = DDP(model, device_ids="
                     "[local_rank] if device.type == 'cuda' else None)")
    else:
        drift_apart(ctx, run, ddp)


def check_gradient_scale(ctx, run, ref) -> bool:
    """The gradients of the first step, as the monitor measured them, are one process's: a
    loss divided by the ranks before backward() (DDP averages already) halves them, and AdamW,
    nearly blind to the scale, keeps the losses close."""
    def first_norm(r):
        return next((e["metrics"]["train/grad_norm"] for e in (r.ranks[0] or {}).get(
            "logged", []) if "train/grad_norm" in e["metrics"]), None)
    mine, theirs = first_norm(run), first_norm(ref)
    if not mine or not theirs or near(mine, theirs, 1e-4):
        return False
    world = run.geometry.world
    why = (f" ({mine / theirs:.2g} x: the loss divided by the {world} ranks before backward(); "
           "DDP averages the gradients itself, so backward gets the rank's own loss, "
           "loss.backward())" if near(mine * world, theirs, 0.01) else
           ": backward gets the rank's own loss as it is, loss.backward(), and DDP averages "
           "the gradients")
    ctx.report.fail(5, f"the first step's gradient norm is {mine:.4g}, one process's "
                    f"{theirs:.4g}{why}")
    return True


DATA_PARALLEL = re.compile(r"(?<!Distributed)DataParallel\b(\s+as\s+(\w+))?")


def drift_apart(ctx, run, ddp) -> None:
    """The ranks' weights differ at the end: why, under TODO 1 or 5. What the run trained,
    saved and evaluated then waits (ctx.extra["ddp_drift"]): it is not one model."""
    rep = ctx.report
    ctx.extra["ddp_drift"] = True
    unsynced = ((run.ranks[0] or {}).get("optimizer_calls") or {}).get("ddp_unsynced_backwards")
    single = DATA_PARALLEL.search(ctx.text)
    if ddp and unsynced:
        rep.fail(5, f"DDP is built, but {unsynced} backward passes ran inside model.no_sync(), "
                 "which switches the all-reduce off (it is for gradient accumulation): the "
                 "ranks' gradients are never averaged and their weights drift apart; train "
                 "outside no_sync(), logits = model(x) and loss.backward()")
    elif ddp:
        rep.fail(5, "DDP is built, but the ranks' weights drift apart: train through the "
                 "wrapper (model = DDP(model, ...), then model(x) in the loop)")
    elif single and single.group(2) == "DDP":
        rep.fail(1, "DDP is imported as torch's DataParallel (one process driving the GPUs of "
                 "one machine), which leaves the ranks apart: from torch.nn.parallel import "
                 "DistributedDataParallel as DDP")
        rep.waits(5, "the wrapper is checked once DDP is DistributedDataParallel (TODO 1's FIX)")
    elif single:
        rep.fail(5, "the model is wrapped in DataParallel (one process driving the GPUs of one "
                 "machine), which leaves the ranks apart: model = DDP(model, device_ids="
                 "[local_rank] if device.type == 'cuda' else None), DistributedDataParallel")
    else:
        rep.fail(5, "the ranks' weights drift apart: wrap the model, model = DDP(model, "
                 "device_ids=[local_rank] if device.type == 'cuda' else None)")


def check_ddp_on_gpus(ctx, run, gpu) -> None:
    """TODO 5 on two pretend nodes of two stand-in GPUs: each process's DDP gets the GPU of its
    local rank."""
    rep = ctx.report
    if run.crashed or rep.failed(5) or not rep.judged(5) or ctx.extra.get("device_again"):
        return  # (a device made by hand after setup(): TODO 2's FIX says so)
    if gpu.crashed:
        f = gpu.failure
        if f is not None and crash_todo(ctx, f) == 5 and not standin.beyond_the_standin(f):
            rep.fail(5, f"on 2 pretend nodes x 2 stand-in GPUs the run would "
                     f"stop{f.where()} with: {f.message}")
        return
    for rank, record in enumerate(gpu.ranks):
        seen = (record or {}).get("gpu", {})
        if not seen.get("ddp"):
            continue
        ddp, local = seen["ddp"][0], seen["device_index"]
        ids = ddp["device_ids"]
        if ids != [local]:
            node = rank // gpu.geometry.per_node
            why = (" (the global rank: there is no such GPU on a node of 2)" if ids == [rank]
                   and rank != local else " (every process of the node on one GPU)"
                   if ids and ids[0] == 0 and local != 0 else "")
            rep.fail(5, f"on 2 pretend nodes x 2 stand-in GPUs, rank {rank} (node {node}, "
                     f"local rank {local}) gives DDP device_ids={ids}{why}: "
                     "device_ids=[local_rank] on a GPU, the GPU setup() gave this process")
            return
        if ddp.get("output_device") not in (None, local):
            rep.fail(5, f"rank {rank} gives DDP output_device={ddp['output_device']}, its GPU "
                     f"is {local}: leave output_device out (it defaults to device_ids[0])")
            return
    rep.ok(5, "on 2 pretend nodes x 2 stand-in GPUs each process's DDP uses the GPU of its "
           "local rank")


def check_loss_on_four_ranks(ctx, run, gpu) -> bool:
    """TODO 7 at another world size: the first logged loss of the 4-rank stand-in GPU run is
    an untrained model's, like the 2-rank run's (within a few percent: other batches). A mean
    that divides by a number written in (all_reduce_sum(loss) / 2) is right on 2 ranks only."""
    mine = ((gpu.summary or {}).get("loss_history") or [None])[0]
    two = run.summary["loss_history"][0] if run.summary["loss_history"] else None
    if gpu.crashed or not mine or not two or near(mine, two, 0.1):
        return True
    ctx.report.fail(7, f"on 4 ranks (the stand-in GPU run) the first logged loss is "
                    f"{mine:.4f}, {mine / two:.2f} times the {two:.4f} on 2 ranks: a number "
                    "written in for the ranks? Divide by the world size, step_loss = "
                    "all_reduce_mean(loss.detach())")
    return False


def check_saves(ctx, run, ref) -> None:
    rep = ctx.report
    if calls(run, "save0"):
        rep.attempt(10)
    others = [s for r in run.ranks[1:] if r for s in r.get("saves", [])]
    if others:
        rep.fail(10, f"rank 1 writes {others[0]['path'].rsplit('/', 1)[-1]} too: save with "
                 "save0(model, path), which writes on rank 0 only (LOCAL_RANK is 0 on every "
                 "node: it does not pick one process of the job)")
        return
    for name in ("final_model.pt", "best_model.pt"):
        check_weights_file(ctx, run, ref, 10, name, ref_name=name,
                           save_with=f"save0(model, out_dir / '{name}')")


def check_teardown(ctx, run, late=None) -> None:
    rep = ctx.report
    destroyed = calls(run, "destroy_process_group") or calls(run, "dist.destroy_process_group")
    if destroyed:
        rep.attempt(11)
    if late:
        rep.fail(11, f"the process group is destroyed before the end (line "
                 f"{destroyed[0]['line']}): after it every rank counts as rank 0, so print0 and "
                 f"save0 run on every rank (rank {late['rank']} {late['what']}): call "
                 "destroy_process_group() last, after del model, optimizer")
    elif not destroyed and not run.ranks[0]["group_alive"]:
        rep.fail(11, "destroy_process_group() is never called: call it at the end of main()")
    elif run.ranks[0]["group_alive"]:
        rep.fail(11, "the process group is still there at the end: del model, optimizer; then "
                 "destroy_process_group()")
    elif run.ranks[0].get("ddp_alive_at_destroy") and re.search(
            r"^\s*del\s+model\b", ctx.text, re.M):
        rep.fail(11, "the DDP model still exists when the process group is destroyed, though "
                 "`del model` ran: something else still holds it (the monitor does until "
                 "monitor.close(summary)): destroy_process_group() last, after monitor.close")
    elif run.ranks[0].get("ddp_alive_at_destroy"):
        rep.fail(11, "the DDP model still exists when the process group is destroyed: "
                 "del model, optimizer before destroy_process_group(), so that DDP's "
                 "communication buffers go while the group still exists")
    else:
        rep.ok(11, "the process group is destroyed at the end")



HINTS = {
    1: ("Everything the other TODOs use must be imported first: the DDP wrapper, the two "
        "samplers (one for training, one for evaluation) and the course's helpers for the "
        "process group, printing, saving and adding up values over ranks.",
        "DistributedDataParallel (as DDP) comes from torch.nn.parallel, DistributedSampler from "
        "torch.utils.data.distributed, DistributedEvalSampler from utils.data; setup, print0, "
        "save0, all_reduce_mean, all_reduce_sum and destroy_process_group from "
        "utils.distributed_utils."),
    2: ("torchrun starts one process per GPU and tells each, in environment variables, who it "
        "is. setup() reads them, joins the process group and picks this process's device; it "
        "also seeds every rank alike.",
        "setup(seed, device) returns four values, in this order: local_rank (the GPU on this "
        "node), rank (the global number), device, world_size. It replaces the three lines that "
        "make the device by hand, the seed and world_size = 1."),
    3: ("With several ranks each must train on its own part of every epoch, and the parts must "
        "add up to the whole data set; evaluation must count every sample exactly once.",
        "torch's DistributedSampler(dataset, num_replicas, rank, shuffle, seed, drop_last) for "
        "training (the global rank, shuffle=True); utils.data.DistributedEvalSampler(dataset, "
        "num_replicas, rank) for validation and test, which pads with samples that count "
        "nowhere instead of repeating real ones."),
    4: ("A sampler only works when the DataLoader uses it; and a DataLoader with a sampler must "
        "not shuffle on its own.",
        "DataLoader(..., sampler=the_sampler, ...) for all three loaders; remove shuffle=True "
        "from the training loader (keep drop_last=True)."),
    5: ("DDP keeps the copies of the model on all ranks identical: it averages their gradients "
        "during backward(). The training loop must run the wrapped model.",
        "DDP (DistributedDataParallel) takes the model and device_ids, the list of this "
        "process's GPU ([local_rank]) on a GPU and None on the CPU; the rest of the script then "
        "uses the wrapped model. Wrap before the optimizer is made."),
    6: ("DistributedSampler shuffles with a seed plus the epoch number: without the epoch "
        "number every epoch gets the first epoch's order.",
        "Call set_epoch(epoch) on the training sampler at the start of every epoch."),
    7: ("Each rank's loss is the loss of its own part of the batch. The loss of the whole "
        "(global) batch is the mean over the ranks, and that is what the log should show.",
        "all_reduce_mean(tensor) from utils.distributed_utils returns the mean over all ranks "
        "(a copy); give it the detached loss."),
    8: ("Each rank evaluated only its share of the split. The loss of the whole split is the "
        "sum of all losses divided by the number of all tokens: add up both over the ranks "
        "first, then divide (a mean of means would weigh the ranks wrongly).",
        "all_reduce_sum(tensor) returns the sum over the ranks; apply it to loss_sum and tokens "
        "before the division."),
    9: ("Every rank runs the same code, so every print appears once per rank. Print the "
        "messages once, on rank 0; data warnings too.",
        "print0(...) from utils.distributed_utils prints on rank 0 only: use it for every print "
        "of the script and pass it as warn= to load_corpus_or_exit."),
    10: ("All ranks hold the same weights: one file is enough, written by rank 0 (several ranks "
         "writing one file would clash). And the file should load into a plain model, without "
         "the DDP wrapper's 'module.' prefix.",
         "save0(model, path) writes the unwrapped model's state dict on rank 0 only."),
    11: ("A process group holds sockets and threads: leave it cleanly at the end, after the "
         "model that uses it is gone.",
         "del model, optimizer; then destroy_process_group() from utils.distributed_utils."),
}
