"""The memory step, train/memory_training.py (TODOs 55-58): gradient accumulation, activation
checkpointing, ZeRO-1, FSDP2 layouts and CPU offload.

Every way of saving memory must train exactly what one process trains on the same global batch,
and must save what it claims. Runs, all next to the solution in one process with a batch of
4 x BATCH: yours as two nodes with --grad-accum 2 (DDP's all-reduces counted by the probe); with
--layout zero1; in one process with --activation-checkpointing; with --layout zero2 and
--layout offload. What each run saved is read from the memory breakdown the script wrote into
summary.json (utils/memory.py: tensors counted, not text read), against the formula.
"""

from __future__ import annotations

from selfcheck.compare import first_difference, near
from selfcheck.runs import ONE, TWO_NODES, Run
from selfcheck.steps.common import check_losses, report_crash

FILE = "train/memory_training.py"
WHAT = "memory: gradient accumulation, activation checkpointing, ZeRO-1/2/3, offload"
TODOS = {55: "gradient accumulation", 56: "activation checkpointing", 57: "ZeRO-1",
         58: "FSDP2 layouts and offload"}
BATCH = 2
COUNT = {"CHECK_COUNT_ALLREDUCES": "1"}
OPTIONAL = {"--grad-accum": 1, "--layout": 1, "--activation-checkpointing": 0}


def check(ctx) -> None:
    rep = ctx.report
    ref = Run(ctx.work, "reference", ctx.root / "solutions" / FILE, BATCH * 4, reference=True,
              env=COUNT)
    runs = {
        55: Run(ctx.work, "grad-accum", ctx.script, BATCH, geometry=TWO_NODES, env=COUNT,
                extra=["--grad-accum", "2"], optional=OPTIONAL),
        57: Run(ctx.work, "zero1", ctx.script, BATCH * 2, geometry=TWO_NODES,
                extra=["--layout", "zero1"], optional=OPTIONAL),
        56: Run(ctx.work, "checkpointing", ctx.script, BATCH * 4, geometry=ONE,
                extra=["--activation-checkpointing"], optional=OPTIONAL),
        "zero2": Run(ctx.work, "zero2", ctx.script, BATCH * 2, geometry=TWO_NODES,
                     extra=["--layout", "zero2"], optional=OPTIONAL),
        "offload": Run(ctx.work, "offload", ctx.script, BATCH * 2, geometry=TWO_NODES,
                       extra=["--layout", "offload"], optional=OPTIONAL),
    }
    for run in runs.values():
        run.wait()
    ref.wait()
    if ref.crashed:
        raise RuntimeError(f"the reference run failed: {ref.failure and ref.failure.message}")
    finished = {}
    for key, run in runs.items():
        todo = key if isinstance(key, int) else 58
        if run.crashed:
            if not rep.failed(todo):
                report_crash(ctx, run, default_todo=todo)
                rep.note(f"(full output of the {run.name} run: {run.dir / 'output.txt'})")
        elif run.summary:
            finished[key] = run
    if 55 in finished:
        check_accumulation(ctx, finished[55], ref)
    if 56 in finished:
        check_checkpointing(ctx, finished[56], ref)
    if 57 in finished:
        check_zero1(ctx, finished[57], ref)
    if "zero2" in finished and "offload" in finished:
        check_fsdp(ctx, finished["zero2"], finished["offload"], ref)


def memory(run, key: str, rank: int = 0):
    return run.summary["memory"]["per_rank"][rank]["measured"][key]


def formula(run, key: str, rank: int = 0):
    return run.summary["memory"]["per_rank"][rank]["formula"][key]


def grad_norms(run) -> list[float]:
    return [e["metrics"]["train/grad_norm"] for e in run.ranks[0].get("logged", [])
            if "train/grad_norm" in e["metrics"]]


def same_training(ctx, run, ref, todo: int, what: str) -> bool:
    """Losses and gradient norms of every step equal the single-process run's. (Says nothing
    when they do: the TODO's own verdict follows; an exercise left as shipped that trains
    right, e.g. AdamW unsharded, stays "not started".)"""
    before = len(ctx.report.verdicts.get(todo, []))
    if not check_losses(ctx, run, ref, todo, what):
        return False
    del ctx.report.verdicts[todo][before:]  # check_losses's ok line
    mine, theirs = grad_norms(run), grad_norms(ref)
    i = first_difference(mine, theirs, 1e-4)
    if i is not None and i < min(len(mine), len(theirs)):
        ratio = mine[i] / theirs[i] if theirs[i] else float("nan")
        ctx.report.fail(todo, f"the gradients differ from the single-process run's from step "
                        f"{i + 1} on (norm {mine[i]:.4g} vs {theirs[i]:.4g}"
                        + (f", {ratio:.2g} times as large" if near(ratio, round(ratio), 0.02)
                           and round(ratio) > 1 else "") + ")")
        return False
    return True


def check_accumulation(ctx, run, ref) -> None:
    rep = ctx.report
    if not run.summary["args"].get("grad_accum") or run.summary["args"]["grad_accum"] != 2:
        return  # the option is the shipped one: nothing else to judge
    losses_ok = same_training(ctx, run, ref, 55, "the losses of 2 micro-batches per step")
    if not losses_ok:
        mine, theirs = run.summary["loss_history"], ref.summary["loss_history"]
        if mine and theirs and near(mine[0] / theirs[0], 2.0, 0.02):
            rep.fail(55, "every step's loss is twice the whole batch's: divide each "
                     "micro-batch's loss by args.grad_accum before backward()")
        return
    steps = run.summary["steps"]
    per_backward = ref.ranks[0].get("allreduces", 0) / max(ref.summary["steps"], 1)
    counted = run.ranks[0].get("allreduces")
    if counted is None or not per_backward:
        return
    if counted > steps * per_backward:
        rep.fail(55, f"DDP all-reduced the gradients {counted} times in {steps} steps, once "
                 f"per micro-batch: run all but the last micro-batch's backward inside "
                 f"no_gradient_sync(model) (DDP's no_sync), so the ranks talk once per step")
    else:
        rep.ok(55, f"2 micro-batches per step train like one process with the whole batch, "
               f"with {counted // steps if steps else 0} all-reduce(s) per step")


def check_checkpointing(ctx, run, ref) -> None:
    rep = ctx.report
    if not run.summary["args"].get("activation_checkpointing"):
        return
    if not same_training(ctx, run, ref, 56, "the losses with activation checkpointing"):
        return
    saved, full, expected = memory(run, "activations"), memory(ref, "activations"), \
        formula(run, "activations")
    if near(saved, full, 0.02):
        rep.fail(56, "the blocks still save all their activations: replace every block of "
                 "model.layers by checkpoint_wrapper(block)")
    elif saved < 0.7 * expected:
        rep.fail(56, f"{saved} bytes of activations, fewer than the {expected:.0f} that "
                 "checkpointing each block keeps: checkpoint each Transformer block on its own, "
                 "not the whole model (whose backward then recomputes everything at once)")
    elif saved > 1.3 * expected:
        rep.fail(56, f"{saved} bytes of activations, more than the {expected:.0f} of every "
                 "block checkpointed whole: wrap each block of model.layers (all of them, "
                 "the whole block)")
    else:
        rep.ok(56, f"each block keeps only its input: {saved / full:.0%} of the activations, "
               "the same losses")


def check_zero1(ctx, run, ref) -> None:
    rep = ctx.report
    if run.summary["args"].get("layout") != "zero1":
        return
    if not same_training(ctx, run, ref, 57, "the losses with --layout zero1"):
        return
    mine, whole = memory(run, "optimizer"), memory(ref, "optimizer")
    if mine > 0.75 * whole:
        rep.fail(57, f"every rank holds AdamW's whole state ({mine} bytes): make the optimizer "
                 "a ZeroRedundancyOptimizer for --layout zero1")
    else:
        rep.ok(57, f"each rank holds {mine / whole:.0%} of AdamW's state, the same losses")


def check_fsdp(ctx, zero2, offload, ref) -> None:
    rep = ctx.report
    for run, name in ((zero2, "zero2"), (offload, "offload")):
        if not same_training(ctx, run, ref, 58, f"the losses with --layout {name}"):
            return
        if memory(run, "parameters") > 0.75 * memory(ref, "parameters"):
            rep.fail(58, f"--layout {name}: every rank holds all the parameters: fully_shard "
                     "each block, then the whole model")
            return
    kept, whole = memory(zero2, "gathered"), memory(ref, "parameters")
    if kept < 0.9 * whole:
        rep.fail(58, "--layout zero2 frees the blocks' gathered weights after forward: "
                 "reshard_after_forward=False for zero2 (True for zero3 and offload)")
        return
    if memory(offload, "gathered") > 1.1 * formula(offload, "gathered"):
        rep.fail(58, "--layout offload keeps the gathered weights until backward: it is "
                 "zero3 with offload, reshard_after_forward=True")
        return
    layout = offload.summary["memory"]["per_rank"][0]["layout"]
    if not layout.get("offload"):
        rep.fail(58, "--layout offload keeps the shards on the device: "
                 "offload_policy=CPUOffloadPolicy() in fully_shard")
        return
    rep.ok(58, "zero2 keeps the whole model gathered until backward, offload shards it into "
           "host memory, both train like one process")


HINTS = {
    55: ("A step of N micro-batches must give the gradient of the whole batch: backward() adds "
         "up gradients, so each micro-batch's loss counts 1/N. And DDP should average the "
         "ranks' gradients once per step, after the last micro-batch, not after every one.",
         "loss = F.cross_entropy(...) / args.grad_accum; wrap forward and backward in "
         "`with contextlib.nullcontext() if last else no_gradient_sync(model):` "
         "(no_gradient_sync calls DDP's model.no_sync())."),
    56: ("Activation checkpointing trades compute for memory: a checkpointed block keeps only "
         "its input and runs its forward again during backward. Per block, so backward "
         "recomputes one block at a time.",
         "from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import "
         "checkpoint_wrapper; for name in list(model.layers): model.layers[name] = "
         "checkpoint_wrapper(model.layers[name]); return model."),
    57: ("ZeRO-1 shards the optimizer state: each rank keeps AdamW's two moments for its own "
         "share of the parameters, updates that share, and broadcasts it to the others.",
         "torch.distributed.optim.ZeroRedundancyOptimizer(model.parameters(), "
         "optimizer_class=torch.optim.AdamW, lr=args.lr, weight_decay=args.weight_decay), "
         "for --layout zero1 only."),
    58: ("FSDP2 shards parameters, gradients and optimizer state (ZeRO-3). Whether a block frees "
         "its gathered weights after forward decides between zero3 (free, gather again for "
         "backward) and zero2 (keep them); offload moves the shards to host memory.",
         "fully_shard(block, reshard_after_forward=layout != 'zero2', offload_policy="
         "CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) for offload) for every block "
         "of model.layers, then fully_shard(model, ...) for the root."),
}
