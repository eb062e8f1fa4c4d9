"""Step 3, train/tp_training.py (TODOs 23-33): tensor parallelism on a 2-D (dp, tp) mesh.

Your script runs as one node with two processes (the TP degree defaults to the processes per
node: tp 2, dp 1) next to the DDP solution in one process with the same batch, and once more in
one process with --tp 3, which cannot split: it must stop with one line (and with --tp 0, which
the parser must refuse). The check looks at the mesh the script built, how every parameter is
split, which batches the ranks read, what the run counts and logs, and the weights it saves.
"""

from __future__ import annotations

import re

from selfcheck.compare import near
from selfcheck.failures import lost_import, lost_import_cause
from selfcheck.runs import ONE, ONE_NODE_TWO, TWO_NODES, Run
from selfcheck.steps.common import (SEQ_LEN, calls, check_eval_exact, check_eval_reads,
                                    check_imports, check_losses, check_tokens,
                                    check_training_shards, check_weights_file, crash_todo,
                                    import_todo, printed_losses,
                                    rank_with_other_initial_weights, rank_todo, ratio_hint,
                                    report_crash, usual_cause, SEED_ALIKE)

FILE = "train/tp_training.py"
WHAT = "tensor parallelism: apply_tp, 2-D mesh, loss_parallel"
TODOS = {23: "imports", 24: "apply_tp", 25: "--tp", 26: "mesh", 27: "samplers count replicas",
         28: "apply_tp call", 29: "FSDP on dp", 30: "loss_parallel", 31: "per replica",
         32: "save_full_model", 33: "evaluate"}
BATCH = 4
SHORT = ["--max-steps", "8"]  # fewer steps, less drift from summing in another order
OPTIONAL = {"--tp": 1}


def check(ctx) -> None:
    rep = ctx.report
    ref = Run(ctx.work, "reference", ctx.root / "solutions/train/to_distributed_training.py",
              BATCH, extra=SHORT, reference=True)
    run = Run(ctx.work, "yours", ctx.script, BATCH, geometry=ONE_NODE_TWO, extra=SHORT,
              eval_probe=True, optional=OPTIONAL)
    bad = Run(ctx.work, "tp3", ctx.script, BATCH, geometry=ONE, optional=OPTIONAL,
              extra=["--tp", "3", "--max-steps", "1"])
    # a degree of 0 is no degree: the parser's type must refuse it (type=int lets it through)
    zero = Run(ctx.work, "tp0", ctx.script, BATCH, geometry=ONE, optional=OPTIONAL,
               extra=["--tp", "0", "--max-steps", "1"])
    # on two nodes with one process each, TP must stay inside a node: --tp defaults to 1, and
    # the two replicas (dp 2) must train and evaluate like one process on the same global batch
    nodes = Run(ctx.work, "two nodes", ctx.script, BATCH // 2, geometry=TWO_NODES,
                optional=OPTIONAL, extra=SHORT, eval_probe=True)
    ref.wait(), run.wait(), bad.wait(), zero.wait(), nodes.wait()
    if ref.crashed:
        raise RuntimeError(f"the reference run failed: {ref.failure and ref.failure.message}")
    records = [r for r in run.ranks if r]
    if not records:
        report_crash(ctx, run)
        return
    r0 = records[0]
    check_option(ctx, run, bad, zero, nodes)
    mesh = check_mesh(ctx, run)
    check_plan(ctx, run)
    if run.crashed:
        lost = None
        if returned_none(run, "apply_tp"):
            report_crash(ctx, run, todo=24, cause="apply_tp returned None, and model = "
                         "apply_tp(model, mesh['tp']) made the model None: end apply_tp with "
                         "return model")
        elif swapped := swapped_sampler_arguments(run):
            report_crash(ctx, run, todo=27, cause=swapped)
        elif tp_after_fsdp(run):
            report_crash(ctx, run, todo=28, cause="apply_tp runs after fully_shard, which made "
                         "the parameters DTensors on the dp mesh already: TP first, model = "
                         "apply_tp(model, mesh['tp']), then fully_shard over mesh['dp']")
        elif r0.get("ddp") and (r0.get("own_calls", {}).get("apply_tp") or [{}])[0].get("returned"):
            report_crash(ctx, run, todo=29, cause="DDP cannot hold the DTensor parameters TP "
                         "made: fully_shard(block, mesh=mesh['dp']) for every block, then "
                         "fully_shard(model, mesh=mesh['dp']), instead of DDP")
        elif mesh == "wrong" and crash_todo(ctx, run.failure) in (27, 31, 32, 33):
            # what the ranks read and count follows from the mesh (TODO 26's FIX says why)
            for todo in (27, 31, 32, 33):
                rep.waits(todo, "it follows from the mesh (fix TODO 26 above first)")
        elif rep.failed(24) and crash_todo(ctx, run.failure) != 23 and \
                not stopped_in_evaluation(run):
            # a wrong plan gives the layers shapes that do not fit: its crash is no new FIX
            # (a plan that trained, the embedding left whole, has no part in evaluate()'s crash)
            report_crash(ctx, run, todo=24, cause=usual_cause(run.failure.message)
                         or "what the plan above does to the shapes (fix the plan first)")
        elif "does not have a sharding strategy" in run.failure.message and \
                calls(run, "loss_parallel"):
            # the loss under loss_parallel() is a DTensor: what the step does with it next fails
            report_crash(ctx, run, todo=30, cause="the loss computed under loss_parallel() is a "
                         "DTensor: take it as a plain tensor, loss = loss.full_tensor(), before "
                         "all_reduce_mean and the loss history")
        elif re.search(r"Target -?\d+ is out of bounds", run.failure.message):
            report_crash(ctx, run, cause="the loss got a rank's slice of the vocabulary only "
                         "(the logits' to_local()?), where targets name any word: compute it on "
                         "the split DTensor logits inside loss_parallel(), then .full_tensor()")
        elif not (lost := report_lost_import(ctx, run)):
            report_crash(ctx, run)
        rep.note(f"(full output: {run.dir / 'output.txt'})")
        check_imports(ctx, 23, run) if not rep.failed(23) else None
        if lost and lost[1] == 23 and rep.judged(23) and not rep.failed(23):
            rep.verdicts[23] = [("ok", f"the step's new names are imported; {lost[0]}'s import "
                                 f"went too early (TODO {lost[2]}'s line says why)")]
        if mesh != "wrong" and stopped_in_evaluation(run):
            check_training_before_evaluation(ctx, run, ref, nodes, mesh)
        return
    check_imports(ctx, 23, run)
    tp = (r0.get("parser", {}).get("values", {}) or {}).get("tp") or 1
    dp = run.geometry.world // tp if tp else 1
    shards_right, evals_read_right = True, True
    if mesh == "wrong":  # what the ranks read and count follows from the mesh
        for todo in (27, 31, 32, 33):
            rep.waits(todo, "it follows from the mesh (fix TODO 26 above first)")
    elif r0.get("meshes"):  # before the mesh, the samplers of the DDP script are right as is
        shards_right = check_training_shards(ctx, run, 27, 27, replicas=dp,
                                             replica_of=lambda r: r // tp, made_is_attempt=False,
                                             given_as="num_replicas=dp_size, rank=dp_rank")
        for split in (1, 2):  # validation, then test: the first wrong one is said
            if check_eval_reads(ctx, run, 27, replicas=dp, replica_of=lambda r: r // tp,
                                made_is_attempt=False, split=split,
                                given_as="num_replicas=dp_size, rank=dp_rank") is False:
                evals_read_right = False
                break
    check_fsdp(ctx, run)
    split = r0.get("tp", {}).get("split")
    if split:
        check_local_params(ctx, run)
    other = rank_with_other_initial_weights(run) if split else None
    if other is not None:
        rep.fail(28, f"rank {other} built the model with other initial weights than rank 0, and "
                 "apply_tp keeps each rank's slice of its own model (DDP broadcast rank 0's "
                 f"weights; tensor parallelism does not), so the split model is a mix of two: "
                 f"{SEED_ALIKE}")
    if split and mesh == "wrong":
        check_loss_parallel(ctx, run)
        if calls(run, "save_full_model"):
            rep.attempt(32)
    elif split:
        # replicas that train on other data than one process: the losses, the weights and the
        # evaluation after training can only differ (TODO 27's FIX says why)
        other_data = ("once each replica trains on its own shard (TODO 27): until then they "
                      "train on other data than one process")
        if other is not None:  # (said above, under TODO 28)
            shards_right = False  # (evaluate() is still compared with the same model's)
            other_data = "once every rank builds the same model (TODO 28's FIX)"
        elif isinstance(given_tp := (r0.get("parser", {}).get("values") or {}).get("tp"), int) \
                and given_tp != run.geometry.per_node:
            # another default than the processes per node: another split of the batch than the
            # reference's, which TODO 25's FIX says (not three more FIX lines)
            shards_right = False
            other_data = (f"once --tp defaults to the processes per node (TODO 25): with tp {tp} "
                          f"this run is dp {dp} x tp {tp}, on {dp} times one process's batch")
        if shards_right and divided_loss(ctx, run, ref, tp):
            shards_right = False  # (evaluate() is still compared with the same model's)
            other_data = "once the loss is not divided (TODO 30's FIX)"
        if shards_right:
            check_losses(ctx, run, ref, 31)
        else:
            rep.waits(31, f"the logged losses are compared with one process's {other_data}")
        check_tokens(ctx, run, 31, BATCH * dp * SEQ_LEN,
                     "throughput.step(x.numel() * dp_size): the ranks of a TP group share one batch")
        check_summary(ctx, run)
        check_loss_parallel(ctx, run)
        if calls(run, "save_full_model"):
            rep.attempt(32)
        if shards_right:
            check_weights_file(ctx, run, ref, 32, "final_model.pt", how=": save_full_model("
                               "model, out_dir / 'final_model.pt') on every rank")
            check_weights_file(ctx, run, ref, 32, "best_model.pt", ref_name="best_model.pt")
        else:
            rep.waits(32, f"the saved weights are compared with one process's {other_data}")
        if not evals_read_right:
            rep.waits(33, "the evaluation is compared with one process's once the ranks of a "
                      "replica evaluate the same samples (TODO 27)")
        elif check_eval_exact(ctx, run, 33, "evaluate(model, loader, device, dp_group): the loss "
                              "inside loss_parallel(), full_tensor(), all_reduce_sum over "
                              "dp_group") and shards_right:
            s = run.summary
            if not (near(s["val_loss"], ref.summary["val_loss"])
                    and near(s["test_loss"], ref.summary["test_loss"])):
                rep.fail(33, f"validation loss {s['val_loss']:.5f}, single process "
                         f"{ref.summary['val_loss']:.5f}")
        if not all(e["resharded"] for e in r0.get("evals", [])):
            rep.fail(33, "after evaluate() the root's gathered weights stay on every rank: "
                     "model.reshard() at the end of evaluate()")
        if mesh == "ok":  # (a wrong dp_group is said under TODO 26)
            check_reduction_groups(ctx, run, dp)
            if other is None:  # (the two-node run mixes its models alike)
                check_replicas(ctx, nodes, ref)


def report_lost_import(ctx, run) -> tuple | None:
    """A NameError for a name the exercise imports as shipped (DDP, save0), whose import went
    before the TODO that replaces its use: under the TODO of the line that uses it, with what
    to do. (name, the TODO whose lines imported it, the TODO that uses it), or None."""
    f = run.failure
    lost = lost_import(f.message, ctx.source, ctx.text) if f else None
    if lost is None or import_todo(ctx, lost[0]) is not None:
        return None  # (a name the solution imports too: that TODO's import is missing)
    used_by = rank_todo(ctx, f)
    todo = report_crash(ctx, run, todo=used_by, cause=lost_import_cause(*lost, f.line, used_by))
    if todo is not None:
        ctx.report.reached_otherwise(todo)  # (not by the TODO done last)
    return (*lost, used_by)


def stopped_in_evaluation(run) -> bool:
    """Every rank that stopped, on its own or waiting for another, did so inside the script's
    evaluate(): the training steps before it ran, and what they did can be judged."""
    f = run.failure
    stopped = [p for p in (f, *f.peers) if p.frames] if f else []
    return bool(stopped) and all(any(fr["func"] == "evaluate" for fr in p.frames)
                                 for p in stopped)


def check_training_before_evaluation(ctx, run, ref, nodes, mesh) -> None:
    """A run that stopped inside evaluate(): the training TODOs judged from what ran before it
    (the samplers, the FSDP units, the loss under loss_parallel, the tokens and the losses of
    the steps logged), as for a run that finished. summary.json and the saves come after the
    evaluation: TODO 31's summary and TODO 32 wait for it."""
    rep = ctx.report
    r0 = run.ranks[0]
    tp = (r0.get("parser", {}).get("values", {}) or {}).get("tp") or 1
    dp = run.geometry.world // tp
    # the TODO whose FIX stopped the run (filed before the training is judged)
    stop = crash_todo(ctx, run.failure)
    if stop not in rep.names or not rep.failed(stop):
        stop = max((n for n in rep.names if rep.failed(n)), default=max(rep.names))
    shards_right = True
    if r0.get("meshes"):  # (before the mesh, the samplers of the DDP script are right as is)
        shards_right = check_training_shards(ctx, run, 27, 27, replicas=dp,
                                             replica_of=lambda r: r // tp, made_is_attempt=False,
                                             given_as="num_replicas=dp_size, rank=dp_rank")
        check_eval_samplers(ctx, run, dp, lambda r: r // tp)
    check_fsdp(ctx, run)
    if r0.get("tp", {}).get("split"):
        check_local_params(ctx, run)
        check_loss_parallel(ctx, run)
        if shards_right:
            check_logged_losses(ctx, run, ref, 31)
        elif rep.failed(27):
            rep.waits(31, "the logged losses are compared with one process's once each replica "
                      "trains on its own shard (TODO 27): until then they train on other data "
                      "than one process")
        check_tokens(ctx, run, 31, BATCH * dp * SEQ_LEN, "throughput.step(x.numel() * "
                     "dp_size): the ranks of a TP group share one batch")
        if mesh == "ok":  # (a wrong dp_group is said under TODO 26)
            check_reduction_groups(ctx, run, dp)
            check_replicas(ctx, nodes, ref)

    def later(todo):
        where = "below" if stop > todo else "above"
        if rep.not_started(stop):
            return f"once TODO {stop} {where} is done (not started yet)"
        return f"once evaluate() runs through (fix TODO {stop} {where} first)"
    if 31 not in rep.waiting:
        rep.waits(31, "summary.json, with the sizes training_summary is told, is written after "
                  f"the evaluation: it is checked {later(31)}")
    rep.waits(32, f"the weights are saved after the evaluation: they are checked {later(32)}")


def check_eval_samplers(ctx, run, replicas, replica_of, where="") -> None:
    """TODO 27 for a run that stopped inside evaluate(), where what the ranks read of a split is
    partial: the validation and test samplers by the arguments they were given (built before
    training). Anything but a DistributedEvalSampler in each loader waits for the reads.
    where: which run it was ("on two nodes (tp 1, dp 2) "), for the FIX line."""
    rep = ctx.report
    for rank, r in enumerate(run.ranks):
        for split, name, var in ((1, "validation", "val"), (2, "test", "test")):
            loader = next((l for l in (r or {}).get("loaders", []) if l["dataset"] == split),
                          None)
            s = r["samplers"][loader["sampler"]] if loader and loader["sampler"] is not None \
                else None
            if s is None or s["kind"] != "DistributedEvalSampler" or loader["drop_last"]:
                rep.waits(27, f"the {name} samples each replica reads are checked once "
                          "evaluate() runs through")
                return
            got = (s["given"].get("num_replicas", 1), s["given"].get("rank", 0))
            if got != (replicas, replica_of(rank)):
                rep.fail(27, f"{where}rank {rank}'s {name} sampler has num_replicas={got[0]}, "
                         f"rank={got[1]}, but it is in replica {replica_of(rank)} of "
                         f"{replicas}: the ranks of a TP group evaluate the same samples, "
                         f"DistributedEvalSampler({var}_ds, num_replicas=dp_size, rank=dp_rank)"
                         + (", the same for test" if split == 1 else ""))
                return


TWICE = ": twice the mean, a sum over 2 replicas? (all_reduce_mean, not all_reduce_sum)"
REDUCTIONS = ("all_reduce_mean", "all_reduce_sum", "dist.all_reduce")
NODES = "on two nodes (tp 1, dp 2) "  # (the FIX lines of the second run begin so)


def check_logged_losses(ctx, run, ref, todo, what="the logged training losses") -> bool | None:
    """check_losses for a run that stopped in its evaluation, before summary.json: the loss the
    logger got at each step (train/loss) and the printed step lines against one process's.
    None where no step was logged."""
    rep = ctx.report
    theirs = ref.summary["loss_history"]
    logged = {e["step"]: e["metrics"]["train/loss"] for e in run.ranks[0].get("logged", [])
              if "train/loss" in e["metrics"]}
    if not logged:
        return None
    beyond = [s for s in logged if not 1 <= s <= len(theirs)]
    if beyond:
        rep.fail(todo, f"a training loss is logged for step {beyond[0]}, the single-process "
                 f"run takes {len(theirs)} steps (1 to {len(theirs)})")
        return False
    wrong = [(s, v) for s, v in sorted(logged.items()) if not near(v, theirs[s - 1])]
    if wrong:
        s, v = wrong[0]
        rep.fail(todo, f"{what} differ from the single-process run from step {s} on "
                 f"({v:.5f} vs {theirs[s - 1]:.5f})" + ratio_hint(v, theirs[s - 1], TWICE))
        return False
    printed = printed_losses(run.outputs[0])
    wrong = [(s, v) for s, v in sorted(printed.items())
             if s in logged and not near(v, logged[s], 1e-3, 1e-3)]
    if wrong:
        s, v = wrong[0]
        rep.fail(todo, f"the step lines print another loss than the logger gets (step {s}: "
                 f"printed {v:.4f}, logged {logged[s]:.4f} as in the single-process run)"
                 + ratio_hint(v, logged[s], TWICE))
        return False
    rep.ok(todo, f"{what} equal the single-process run ({len(logged)} steps before the "
           "evaluation)")
    return True


def divided_loss(ctx, run, ref, tp) -> bool:
    """TODO 30: the first step's loss and gradient norm 1/tp of one process's: the loss was
    divided by the TP degree before backward(), as if each rank held a part of it (the loss
    loss_parallel returns is the whole batch's mean on every rank of the TP group already).
    A FIX line, and True; a loss divided for the log only is TODO 31's (its losses differ)."""
    def first(r, key):
        return next((e["metrics"][key] for e in (r.ranks[0] or {}).get("logged", [])
                     if key in e["metrics"]), None)
    if tp < 2:
        return False
    loss, norm = first(run, "train/loss"), first(ref, "train/loss")
    grad, ref_grad = first(run, "train/grad_norm"), first(ref, "train/grad_norm")
    if not (near(loss, norm / tp, 0.01) if loss and norm else False) or \
            not (near(grad, ref_grad / tp, 0.01) if grad and ref_grad else False):
        return False
    part = "half" if tp == 2 else f"1/{tp}"
    ctx.report.fail(30, f"the first step's loss ({loss:.5f}) and gradient norm ({grad:.4g}) are "
                    f"{part} one process's ({norm:.5f}, {ref_grad:.4g}): the loss is divided "
                    f"by {tp} (the tp degree?) before backward(), but under loss_parallel() "
                    "every rank of the TP group gets the whole batch's mean already; backward on "
                    "it as it is, loss = F.cross_entropy(...) without / args.tp")
    return True


def check_loss_parallel(ctx, run) -> None:
    rep = ctx.report
    if any(c["func"] == "main" for c in calls(run, "loss_parallel")):
        rep.attempt(30)
        rep.ok(30, "the loss over the split logits runs under loss_parallel")
    else:
        rep.fail(30, "the loss never runs under loss_parallel(): gathering the whole "
                 "logits (full_tensor) works, but costs the memory and traffic TP saves: "
                 "with loss_parallel(): loss = F.cross_entropy(...); loss.backward()")


def check_local_params(ctx, run) -> None:
    """TODO 28: the parameters a rank reports holding are its shards, not the whole model. From
    summary.json, or for a run that stopped before it (in evaluate()), from the script's
    local_params as the first training step saw it."""
    given = (run.summary or {}).get("params_per_rank")
    if run.summary is None:
        given = ((run.ranks[0] or {}).get("step_locals") or {}).get("local_params")
        if given is None:
            ctx.report.waits(28, "the parameters per rank (local_params) are checked in "
                             "summary.json once evaluate() runs through")
            return
    desc = (run.ranks[0] or {}).get("tp") or {}
    whole, mine = desc.get("numel"), desc.get("tp_local_numel")
    if not isinstance(given, (int, float)) or not whole or not mine or \
            abs(given - mine) <= 0.01 * whole:
        return
    r0 = run.ranks[0] or {}
    counted = (r0.get("step_locals") or {}).get("local_params")
    before = ((r0.get("own_calls", {}).get("apply_tp") or [{}])[0].get("locals_before")
              or {}).get("local_params")
    if run.summary is not None and isinstance(counted, int) and \
            abs(counted - mine) <= 0.01 * whole:
        # the script counted right; training_summary was told another number (TODO 31)
        ctx.report.fail(31, f"summary.json's params_per_rank is {given:.0f}, but local_params "
                        f"is {counted}, what rank 0 holds after apply_tp: "
                        "params_per_rank=local_params to training_summary")
        return
    if before is not None and before == given and given >= whole:
        ctx.report.fail(28, f"local_params is {given:.0f}, the whole model's count: it is "
                        "counted before apply_tp splits the model; count it after model = "
                        f"apply_tp(model, mesh['tp']), where rank 0 holds {mine} of the "
                        f"{whole} parameters")
        return
    why = ("the whole model's count: a DTensor's numel() is its global size" if given >= whole
           else "not what this rank holds")
    ctx.report.fail(28, f"local_params is {given:.0f}, {why}; after apply_tp rank 0 holds "
                    f"{mine} of the {whole} parameters: count p.to_local().numel() for a "
                    "DTensor, p.numel() for a plain tensor")


def check_reduction_groups(ctx, run, dp) -> None:
    """TODOs 31 and 33: the loss and the evaluation sums are reduced over the dp group. (Over
    all ranks the number comes out the same, since the ranks of a TP group hold the same
    values: communication for nothing, and it only shows in which group each call used.)"""
    rep = ctx.report
    for todo, func, what in ((31, "main", "the training loss is"),
                             (33, "evaluate", "the evaluation's loss sum and token count are")):
        wide = [c for name in REDUCTIONS for c in calls(run, name, rank=0)
                if c["func"] == func and c["direct"] and c.get("group_size") not in (None, dp)]
        if wide and not rep.failed(todo):
            rep.fail(todo, f"{what} reduced over a group of {wide[0]['group_size']} "
                     f"processes (line {wide[0]['line']}), the data-parallel group has {dp}: "
                     "the ranks of a TP group hold the same values (adding them up sends for "
                     "nothing), the replicas different ones; reduce over dp_group only"
                     + (", all_reduce_mean(..., group=dp_group)" if todo == 31
                        else ", all_reduce_sum(t, dp_group)"))


def check_replicas(ctx, nodes, ref) -> None:
    """On two nodes with one process each (tp 1, dp 2): the loss averaged and the evaluation
    added up over the two replicas, as one process on the whole batch. A run that stopped
    inside evaluate() shows its training only, and its stop is TODO 33's FIX; one that stopped
    elsewhere (where the run above did not) is the FIX of the TODO of its line."""
    rep = ctx.report
    evaluated = not nodes.crashed and nodes.summary
    in_evaluation = nodes.crashed and stopped_in_evaluation(nodes)
    tp = ((nodes.ranks[0] or {}).get("parser", {}).get("values", {}) or {}).get("tp")
    if nodes.crashed and not in_evaluation:
        if tp in (None, 1):  # (another --tp is TODO 25's FIX)
            report_nodes_crash(ctx, nodes)
        return
    if not (evaluated or in_evaluation):
        return
    if tp != 1 or evaluated and rep.failed(31) and rep.failed(33):
        return
    # dp 2 shows what dp 1 cannot: which samples each replica reads, and the tokens of both
    # (their ok lines are said once, for the run above)
    said = {todo: len(rep.verdicts.get(todo, [])) for todo in (27, 31)}
    check_training_shards(ctx, nodes, 27, 27, replicas=2, replica_of=lambda r: r,
                          made_is_attempt=False, given_as="num_replicas=dp_size, rank=dp_rank")
    if evaluated:
        for split in (1, 2):
            check_eval_reads(ctx, nodes, 27, replicas=2, replica_of=lambda r: r,
                             made_is_attempt=False, split=split,
                             given_as="num_replicas=dp_size, rank=dp_rank")
    else:  # (what it read of the split is partial)
        check_eval_samplers(ctx, nodes, 2, lambda r: r, where=NODES)
    check_tokens(ctx, nodes, 31, BATCH * SEQ_LEN, "throughput.step(x.numel() * dp_size): "
                 "each replica trains on its own batch", prefix=NODES)
    for todo, before in said.items():
        rep.verdicts[todo] = rep.verdicts[todo][:before] + [
            v for v in rep.verdicts[todo][before:] if v[0] != "ok"]
    if in_evaluation:  # (after what it trained is judged: the crash is TODO 33's alone)
        report_nodes_crash(ctx, nodes, default_todo=33)
    if rep.failed(27):
        return  # the replicas read other data than one process: nothing to compare yet
    if not rep.failed(31):
        before = len(rep.verdicts.get(31, []))
        compare = check_losses if evaluated else check_logged_losses
        if compare(ctx, nodes, ref, 31, NODES + "the logged losses"):
            del rep.verdicts[31][before:]  # (said once, for the run above)
        elif evaluated and history_alone_differs(nodes, ref):
            rep.verdicts[31][-1] = ("FIX", NODES + "the step lines print one process's losses, "
                                    "but summary.json's loss_history holds others: each "
                                    "replica keeps its own loss there; keep the averaged one, "
                                    "loss_history.append(step_loss)")
        elif not reduces_loss(nodes) and rep.verdicts[31][-1][0] == "FIX":
            kind, text = rep.verdicts[31][-1]
            rep.verdicts[31][-1] = (kind, text + ": each replica logs the loss of its own "
                                    "batch; average it over the replicas, step_loss = "
                                    "all_reduce_mean(loss.detach(), group=dp_group)")
    if evaluated and not rep.failed(33):
        before = len(rep.verdicts.get(33, []))
        if check_eval_exact(ctx, nodes, 33, NODES + "the replicas evaluated "
                            "different samples: add up loss_sum and tokens over dp_group, "
                            "all_reduce_sum(t, dp_group)"):
            del rep.verdicts[33][before:]


def history_alone_differs(run, ref) -> bool:
    """The printed step lines (rank 0's) are one process's losses at every step they show,
    the loss history in summary.json is not."""
    theirs = ref.summary["loss_history"]
    printed = {s: v for s, v in printed_losses(run.outputs[0]).items() if 1 <= s <= len(theirs)}
    mine = (run.summary or {}).get("loss_history") or []
    return bool(printed) and len(mine) == len(theirs) and all(
        near(v, theirs[s - 1], 1e-3, 1e-3) for s, v in printed.items()) and not all(
        near(float(m), t) for m, t in zip(mine, theirs, strict=True))


def reduces_loss(run) -> bool:
    """The script itself, on rank 0, all-reduced something outside evaluate() (the loss)."""
    return any(c["func"] != "evaluate" and c["direct"]
               for name in REDUCTIONS for c in calls(run, name, rank=0))


def report_nodes_crash(ctx, nodes, default_todo=None) -> None:
    """The run on two nodes stopped where the run on one did not: under the TODO of the line it
    stopped at (default_todo where no TODO owns it), unless that TODO has its FIX already (the
    crash of the run above, said once)."""
    f = nodes.failure
    todo = (crash_todo(ctx, f) or default_todo) if f else None
    if f is None or todo is not None and ctx.report.failed(todo):
        return
    cause = None
    if re.search(r"'Tensor' object has no attribute '(full_tensor|to_local|redistribute)'",
                 f.message):
        cause = ("with one process per node --tp is 1, and this is a plain tensor there, not "
                 "a DTensor: apply_tp must split the model for tp 1 as well (a tp dim of size 1 "
                 "splits nothing and costs nothing), or take .full_tensor() only of a DTensor")
    report_crash(ctx, nodes, todo=todo, cause=cause, prefix=NODES)


def check_option(ctx, run, bad, zero, nodes) -> None:
    rep = ctx.report
    parser = (run.ranks[0] or {}).get("parser", {})
    given = ((bad.ranks[0] or {}).get("parser", {}).get("values", {}) or {}).get("tp")
    if isinstance(given, str):
        rep.fail(25, f"--tp 3 arrives as the string {given!r}: add_argument('--tp', "
                 "type=positive_int, ...)")
        return
    if "--tp" in parser.get("missing", []) or "--tp" not in parser.get("options", ["--tp"]):
        if rep.status.get(25) != "not started":
            rep.fail(25, "there is no --tp option yet: parser.add_argument('--tp', "
                     "type=positive_int, default=int(os.environ.get('LOCAL_WORLD_SIZE', 1)))")
        else:
            rep.fail(25, "no --tp option")
        return
    rep.attempt(25)
    f = bad.failure
    key = re.search(r"KeyError: '(\w+)'", f.message) if f else None
    if key and (ctx.todo_of(f.line) == 25 or key.group(1) in ("LOCAL_WORLD_SIZE", "WORLD_SIZE")):
        rep.fail(25, f"a plain python run stops at line {f.line} with KeyError: "
                 f"'{key.group(1)}': only torchrun sets it, default=int(os.environ.get("
                 f"'{key.group(1)}', 1))")
        return
    tp = parser.get("values", {}).get("tp")
    if tp != run.geometry.per_node:
        rep.fail(25, f"--tp defaults to {tp} with {run.geometry.per_node} processes on the node: "
                 "default=int(os.environ.get('LOCAL_WORLD_SIZE', 1))")
    else:
        on_nodes = ((nodes.ranks[0] or {}).get("parser", {}).get("values", {}) or {}).get("tp")
        zero_taken = zero_accepted(zero)
        if on_nodes is not None and on_nodes != 1:
            rep.fail(25, f"on two nodes with one process each --tp defaults to {on_nodes}: TP "
                     "must stay inside a node, default=int(os.environ.get('LOCAL_WORLD_SIZE', 1)) "
                     "(the processes of this node, not WORLD_SIZE)")
        elif zero_taken:
            rep.fail(25, f"--tp 0 is taken as a degree, and the run {zero_taken}: the parser must "
                     "refuse 0 and negative degrees in one line, add_argument('--tp', "
                     "type=positive_int, ...) instead of type=int")
        else:
            rep.ok(25, f"--tp defaults to the processes per node ({tp})")
    # --tp 3 in one process cannot split: one line, no traceback (check_tp_degree, TODO 26)
    b = bad.ranks[0] or {}
    if "--tp" in b.get("parser", {}).get("missing", []):
        return
    f = bad.failure
    if f is None:
        rep.fail(26, "with --tp 3 in one process the run went on: call check_tp_degree(args.tp, "
                 "world_size, cfg) before building the mesh")
    elif not (f.kind == "exit" and f.message.startswith("error:")):
        rep.fail(26, f"with --tp 3 in one process the run ends in {f.message[:80]!r} instead of "
                 "one line saying what to change: check_tp_degree(args.tp, world_size, cfg) "
                 "first")


def zero_accepted(zero) -> str | None:
    """What the run given --tp 0 did once its parser took the 0 ("went on", "stopped in ..."),
    or None where the parser refused it (or the script has no --tp yet)."""
    r = zero.ranks[0] or {}
    if (r.get("parser", {}).get("values", {}) or {}).get("tp") != 0:
        return None
    f = zero.failure
    if f is None:
        return "went on"
    if f.kind == "exit" and f.message.startswith("error:"):
        return None  # (a one-line stop after the parser, the script's own check: fine too)
    return f"stopped with {f.message[:80]!r}"


def check_mesh(ctx, run) -> str:
    """The mesh the script built: 2-D (dp, tp), tp the inner (fast-changing) dimension.
    "ok", "wrong" (the mesh or dp_rank/dp_size: what the ranks read and count follows), or
    "group" (dp_group alone)."""
    rep = ctx.report
    meshes = [(r["rank"], m) for r in run.ranks if r for m in r.get("meshes", [])]
    if not meshes:
        if ctx.status.get(26) == "edited":
            rep.fail(26, "no device mesh was built: mesh = init_device_mesh(device.type, "
                     "(world_size // args.tp, args.tp), mesh_dim_names=('dp', 'tp'))")
        return "ok"
    rep.attempt(26)
    tp = (run.ranks[0].get("parser", {}).get("values", {}) or {}).get("tp") or 2
    world = run.geometry.world
    for rank, m in meshes:
        names, shape = m["names"], m["shape"]
        if sorted(names) != ["dp", "tp"] or len(shape) != 2:
            rep.fail(26, f"the mesh has dims {names or 'without names'} of sizes {shape}: two "
                     "named dims, mesh_dim_names=('dp', 'tp')")
            return "wrong"
        sizes = dict(zip(names, shape, strict=True))
        if names == ["tp", "dp"] and shape == [world // tp, tp] and tp != world // tp:
            rep.fail(26, f"the shape is right, (world_size // args.tp, args.tp) = {tuple(shape)}, "
                     "but the names say the first dim is tp: name the dims in the shape's "
                     "order, mesh_dim_names=('dp', 'tp')")
            return "wrong"
        if sizes["tp"] != tp or sizes["dp"] != world // tp:
            rep.fail(26, f"the mesh is dp {sizes['dp']} x tp {sizes['tp']} with --tp {tp} on "
                     f"{world} processes: (world_size // args.tp, args.tp), in that order")
            return "wrong"
        if names != ["dp", "tp"]:
            rep.fail(26, "tp must be the inner dim, so a TP group is neighbouring ranks on one "
                     "node: mesh_dim_names=('dp', 'tp') with shape (world_size // tp, tp)")
            return "wrong"
        coords = m.get("coords")
        if coords and coords != [rank // tp, rank % tp]:
            rep.fail(26, f"rank {rank} sits at {coords} of the mesh, expected "
                     f"{[rank // tp, rank % tp]}")
            return "wrong"
    # the script's dp_rank and dp_size, seen where it built its samplers
    for r in run.ranks:
        for s in (r or {}).get("samplers", []):
            loc = s.get("locals", {})
            want_rank, want_size = r["rank"] // tp, world // tp
            if loc.get("dp_rank", want_rank) != want_rank:
                in_tp, global_ = loc["dp_rank"] == r["rank"] % tp, loc["dp_rank"] == r["rank"]
                which = {(True, True): "its place in its TP group (the tp dim) or the global "
                                       "rank", (True, False): "its place in its TP group (the "
                         "tp dim)", (False, True): "the global rank"}.get((in_tp, global_),
                                                                          "not its replica")
                rep.fail(26, f"on rank {r['rank']} dp_rank is {loc['dp_rank']}, {which}; its "
                         f"replica is {want_rank}: dp_rank = mesh['dp'].get_local_rank()")
                return "wrong"
            if loc.get("dp_size", want_size) != want_size:
                rep.fail(26, f"dp_size is {loc['dp_size']}, the mesh has {want_size} replicas: "
                         "dp_size = mesh['dp'].size()")
                return "wrong"
            # the ranks holding the same shard in the other replicas: same tp index
            group = s.get("groups", {}).get("dp_group")
            replicas = list(range(r["rank"] % tp, world, tp))
            if group is not None and sorted(group) != replicas:
                rep.fail(26, f"on rank {r['rank']} dp_group holds ranks {sorted(group)}, its "
                         f"data-parallel group is ranks {replicas} (the same place in the "
                         "other replicas): dp_group = mesh['dp'].get_group()")
                return "group"
    rep.ok(26, f"the mesh is dp {world // tp} x tp {tp}, tp the inner dim")
    return "ok"


def swapped_sampler_arguments(run) -> str | None:
    """A sampler given dp_rank and dp_size in each other's places (positionally: the order is
    dataset, num_replicas, rank): replica 0 then has 0 replicas and stops dividing by it."""
    tp = ((run.ranks[0] or {}).get("parser", {}).get("values", {}) or {}).get("tp")
    if not isinstance(tp, int) or tp < 1:
        return None
    dp = run.geometry.world // tp
    for rank, record in enumerate(run.ranks):
        for s in (record or {}).get("samplers", []):
            given = s["given"]
            if given.get("num_replicas") == rank // tp != dp and given.get("rank") == dp:
                return (f"{s['kind']}(dataset, num_replicas, rank) takes the count first: "
                        f"rank {rank} got num_replicas={rank // tp}, rank={dp} (line "
                        f"{s['line']}), dp_rank and dp_size the other way round; pass them as "
                        "keywords, num_replicas=dp_size, rank=dp_rank")
    return None


def returned_none(run, name) -> bool:
    """The run stopped on a None where the script's own function `name` had returned None."""
    f = run.failure
    return bool(f and "'NoneType' object" in f.message and any(
        c.get("none") for c in (run.ranks[0] or {}).get("own_calls", {}).get(name, [])))


def tp_after_fsdp(run) -> bool:
    """The run stopped where parallelize_module met parameters fully_shard had split already."""
    return bool(run.crashed and run.failure and "Cannot distribute a DTensor with device mesh"
                in run.failure.message)


def check_plan(ctx, run) -> None:
    """TODO 24 (the plan) and 28 (the call): judged once apply_tp has run on rank 0."""
    rep = ctx.report
    r0 = run.ranks[0]
    applied = r0.get("own_calls", {}).get("apply_tp", [])
    if applied:
        rep.attempt(28)
        mesh = applied[0]["args"][1] if len(applied[0]["args"]) > 1 else \
            applied[0]["kwargs"].get("tp_mesh", {})
        if isinstance(mesh, dict) and mesh.get("type") == "DeviceMesh" and \
                mesh.get("names") != ["tp"]:
            rep.fail(28, f"apply_tp gets the mesh of dims {mesh.get('names')}: give it the tp "
                     "dim only, apply_tp(model, mesh['tp'])")
            return
    elif "apply_tp" in r0.get("defined", []):
        # (a run that stopped before TODO 28's lines never got to call it)
        reached = not run.crashed or (crash_todo(ctx, run.failure) or 0) > 28
        if r0.get("meshes") and reached and (ctx.status.get(28) == "edited" or not run.crashed):
            rep.fail(28, "apply_tp is never called: model = apply_tp(model, mesh['tp'])")
        rep.waits(24, "apply_tp is checked once TODO 28 calls it")
    if not (applied and applied[0].get("returned")) and not calls(run, "parallelize_module"):
        return
    rep.attempt(24)
    if tp_after_fsdp(run):
        return  # the plan met FSDP's DTensors: the order is TODO 28's (the crash says so)
    if run.crashed and not (applied and applied[0].get("returned")) and run.failure \
            and crash_todo(ctx, run.failure) not in (None, 24):
        # another rank stopped elsewhere (a sampler's rank) while this one waited inside the
        # plan: the model is split only in part, and the crash names its own TODO
        return
    # the split right after apply_tp returned, else at the end of the run
    desc = (applied[0].get("plan") if applied else None) or r0.get("tp") or {}
    wrong = desc.get("wrong", [])
    outputs = r0.get("outputs", [])
    local = next((o for o in outputs if o["type"] != "DTensor" and o["vocab"]
                  and o["shape"][-1] < o["vocab"]), None)
    whole = next((o for o in outputs if o["type"] == "DTensor" and o.get("placements")
                  and all(p == "R" or p.startswith("Replicate") for p in o["placements"])),
                 None)
    # the token ids are whole on every rank; RowwiseParallel expects its input split (Shard(-1))
    # unless told otherwise, and then sees a sequence tp times as long
    emb = [style for c in calls(run, "parallelize_module", rank=0)
           for name, style in (c.get("plan") or {}).items() if name.split(".")[-1] == "tok_emb"]
    if wrong:
        rep.fail(24, "not split as planned: " + "; ".join(wrong[:3]))
    elif emb and emb[0]["input_layouts"] and emb[0]["input_layouts"] != ["R"]:
        rep.fail(24, f"the embedding's input layout is {emb[0]['input_layouts'][0]}: its input, "
                 "the token ids, is the same on every rank, so say so, 'tok_emb': "
                 "RowwiseParallel(input_layouts=Replicate())")
    elif whole:
        rep.fail(24, "the model returns its logits whole on every rank (Replicate()): "
                 "loss_parallel needs them split over the vocabulary, as the output layer "
                 "computes them, 'output': ColwiseParallel(use_local_output=False) without "
                 "output_layouts")
    elif local:
        rep.fail(24, f"the model returns plain logits of {local['shape'][-1]} of the "
                 f"{local['vocab']} words on each rank: keep them a DTensor for loss_parallel, "
                 "'output': ColwiseParallel(use_local_output=False)")
    elif applied and applied[0].get("returned"):
        rep.ok(24, "q/k/v and in_proj column-wise, out_proj row-wise, the embedding and the "
               "output layer over the vocabulary")
    used = r0.get("meshes_used", {})
    if any("tp" in names.split(",") for names in used):
        rep.ok(28, "apply_tp(model, mesh['tp']) split the model over the tp dim")


def check_fsdp(ctx, run) -> None:
    rep = ctx.report
    r0 = run.ranks[0]
    if r0.get("ddp"):
        if rep.status.get(29) == "not started":
            rep.fail(29, "DDP still wraps the model")
        else:
            rep.fail(29, "the model is still wrapped in DDP, which cannot take DTensors: "
                     "fully_shard(block, mesh=mesh['dp']) for every block, then "
                     "fully_shard(model, mesh=mesh['dp'])")
        return
    units = r0.get("fsdp")
    if not units:
        rep.fail(29, "no FSDP unit: fully_shard(block, mesh=mesh['dp']) for every block, then "
                 "fully_shard(model, mesh=mesh['dp'])")
        return
    rep.attempt(29)
    used = r0.get("meshes_used", {})
    if not (all(units["blocks"]) and units["root"]):
        rep.fail(29, f"FSDP units: blocks {units['blocks']}, root {units['root']}: "
                 "fully_shard every block, then the root, on mesh['dp']")
    elif not any("dp" in names.split(",") for names in used):
        rep.fail(29, "FSDP does not shard over the dp dim: fully_shard(..., mesh=mesh['dp'])")
    # (not after a crash: one inside a forward leaves FSDP's gathered parameters in the
    # model's place, which no optimizer holds)
    elif r0.get("optimizer_holds_model") is False and not run.crashed:
        rep.fail(29, "the optimizer was made before apply_tp and fully_shard: it holds the "
                 "parameters they replaced, so the model never changes; make the optimizer "
                 "after fully_shard(model, ...)")
    else:
        rep.ok(29, "every block and the root are fully_shard-ed on the dp mesh")


def check_summary(ctx, run) -> None:
    rep = ctx.report
    s = run.summary
    r0 = run.ranks[0]
    tp = (r0.get("parser", {}).get("values", {}) or {}).get("tp")
    dp = run.geometry.world // tp if tp else None
    problems = []  # what is missing or wrong first, each with what to pass
    if s.get("params_per_rank") is None:
        problems.append("params_per_rank is missing from summary.json: pass "
                        "params_per_rank=local_params to training_summary")
    if s.get("tensor_parallel_size") is None:
        problems.append("tensor_parallel_size is missing from summary.json: pass "
                        "tensor_parallel_size=args.tp to training_summary")
    elif s["tensor_parallel_size"] != tp:
        problems.append(f"summary.json's tensor_parallel_size is {s['tensor_parallel_size']}, "
                        f"the run has tp {tp}: tensor_parallel_size=args.tp")
    if s.get("global_batch_size") != BATCH * (dp or 1):
        problems.append(f"summary.json's global batch is {s.get('global_batch_size')}, expected "
                        f"{BATCH * (dp or 1)} (--batch-size {BATCH} times {dp} replica(s); "
                        "without data_parallel_size training_summary counts every process): "
                        "data_parallel_size=dp_size to training_summary")
    if problems:
        rep.fail(31, "; ".join(problems))


HINTS = {
    23: ("Tensor parallelism needs a device mesh, the parallel styles, the loss over split "
         "logits, FSDP for the data-parallel dimension and the gathering save.",
         "os; init_device_mesh (torch.distributed.device_mesh); Replicate "
         "(torch.distributed.tensor); parallelize_module, ColwiseParallel, RowwiseParallel and "
         "loss_parallel (torch.distributed.tensor.parallel); fully_shard "
         "(torch.distributed.fsdp); save_full_model (utils.checkpointing)."),
    24: ("Megatron's split: the first linear layer of attention and of the MLP column-wise "
         "(each rank some heads or hidden units), the second row-wise (an all-reduce adds the "
         "parts); the embedding and the output layer split over the vocabulary.",
         "apply_tp(model, tp_mesh): parallelize_module(block, tp_mesh, {name: style}) for every "
         "block (q/k/v_proj and mlp.in_proj ColwiseParallel(), out_projs RowwiseParallel()), "
         "then parallelize_module(model, tp_mesh, {'tok_emb': RowwiseParallel(input_layouts="
         "Replicate()), 'output': ColwiseParallel(use_local_output=False)})."),
    25: ("The TP degree is an option; by default the processes of one node, because TP talks "
         "in every layer and needs the fast links inside a node.",
         "parser.add_argument('--tp', type=positive_int, default=...) with the default from "
         "the LOCAL_WORLD_SIZE environment variable (torchrun sets it)."),
    26: ("Arrange the ranks in a grid: rows are data-parallel replicas, columns the ranks of "
         "one TP group; TP is the inner dimension, so neighbouring ranks (one node) share "
         "layers. Stop first if the model or the world cannot be split.",
         "check_tp_degree(args.tp, world_size, cfg); init_device_mesh(device.type, (dp, tp), "
         "mesh_dim_names=('dp', 'tp')); the dp rank, size and group from mesh['dp']: "
         "get_local_rank(), size(), get_group()."),
    27: ("The ranks of a TP group compute on the same batch: the samplers count data-parallel "
         "replicas, not processes.",
         "num_replicas=dp_size, rank=dp_rank in the three samplers."),
    28: ("Apply the plan on the TP dimension only, and report what each rank now holds.",
         "model = apply_tp(model, mesh['tp']); local_params sums p.to_local().numel() over the "
         "DTensor parameters (p.numel() for the others)."),
    29: ("Gradients are averaged over the data-parallel replicas only, and DDP cannot take "
         "DTensor parameters: FSDP on the dp dimension does both.",
         "fully_shard(block, mesh=mesh['dp']) for every block, then fully_shard(model, "
         "mesh=mesh['dp']), instead of DDP."),
    30: ("The logits are split over the vocabulary: loss_parallel computes the cross-entropy on "
         "the pieces with small all-reduces instead of gathering them; backward must run inside "
         "it too. The loss comes back as a DTensor, the same on every rank of the group.",
         "with loss_parallel(): the loss, zero_grad and backward; then loss.full_tensor()."),
    31: ("A TP group trains on one batch: tokens and losses are counted per replica, and the "
         "summary says how the world was split.",
         "throughput.step(x.numel() * dp_size); all_reduce_mean(..., group=dp_group); "
         "training_summary(..., data_parallel_size=dp_size, tensor_parallel_size=args.tp, "
         "params_per_rank=local_params)."),
    32: ("The weights are DTensors, split over the ranks: gather them to save one ordinary "
         "file (a collective).",
         "save_full_model(model, path) on every rank, for best and final."),
    33: ("Evaluation meets the same split logits as training, and its sums are added up over "
         "the replicas only (a TP group evaluated the same samples).",
         "evaluate(model, loader, device, dp_group): the loss inside loss_parallel() with "
         ".full_tensor(), all_reduce_sum(t, dp_group), then model.reshard()."),
}
