"""Step 2, train/fsdp_training.py (TODOs 17-22): FSDP2, sharded checkpoints, resume, export.

Four runs: the solution in one process (the reference); yours as two nodes with one process
each; yours again, stopped at step 7 (in the middle of the second epoch) with
--checkpoint-every 3 and --reshard-after-forward false; and yours resumed in ONE process from
that run's checkpoint (another world size: DCP reshards). The resumed run must end exactly like
the uninterrupted one: the same losses, weights, optimizer state and number of steps, and it
must not forget the best validation loss it had (the check sets it in the checkpoint, under the
key that holds it, to a value no evaluation can beat: a run that forgot it saves a new "best"),
and rank 0 must say where it resumed from and at which step.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from selfcheck.compare import (first_difference, first_different_tensor, load_checkpoint_state,
                               near)
from selfcheck.runs import ONE, TWO_NODES, Run
from selfcheck.steps.common import (SEED_ALIKE, calls, check_eval_exact, check_imports,
                                    check_losses, check_weights_file, crash_todo,
                                    imported_as_other, inner_units,
                                    rank_with_other_initial_weights, report_crash)

FILE = "train/fsdp_training.py"
WHAT = "FSDP2: fully_shard, sharded checkpoints, resume, full export"
TODOS = {17: "imports", 18: "apply_fsdp", 19: "FSDP instead of DDP, reshard",
         20: "sharded checkpoints", 21: "resume", 22: "save_full_model"}
BATCH = 4
STOP_AT = 7           # steps of the interrupted run: mid second epoch (5 steps per epoch)
CHECKPOINT_EVERY = 3
UNBEATABLE = 1e-9     # the best validation loss the check writes into the checkpoint
OPTIONAL = {"--reshard-after-forward": 1, "--checkpoint-every": 1, "--resume": 1}
# each key of train_state: what goes there, and what reads it back
TRAIN_STATE = {
    "step": ("step", "resume_position reads it (the step to go on from)"),
    "epoch": ("epoch", "resume_position reads it (the epoch to go on in)"),
    "batches_done": ("batches_done, the batches trained in this epoch",
                     "resume_position reads it (the batches to skip)"),
    "global_batch": ("global_batch", "resume_position compares it with this run's"),
    "best_val": ("best_val, the lowest validation loss so far", "your TODO 21 code restores it "
                 "(else a resumed run saves a new 'best' at its first evaluation)"),
    "loss_history": ("[loss.item() for loss in loss_history]",
                     "your TODO 21 code restores it (the whole run's losses)"),
    "model_config": ("cfg.to_dict()", "load_sharded_model compares it with this run's model"),
}
OWN_KEYS = ("best_val", "loss_history")  # read back by the script's own code: any name will do


def check(ctx) -> None:
    rep = ctx.report
    ref = Run(ctx.work, "reference", ctx.root / "solutions" / FILE, BATCH * 2, reference=True)
    run = Run(ctx.work, "yours", ctx.script, BATCH, geometry=TWO_NODES, eval_probe=True,
              extra=["--reshard-after-forward", "true"], optional=OPTIONAL)
    stop = Run(ctx.work, "stopped", ctx.script, BATCH, geometry=TWO_NODES, optional=OPTIONAL,
               eval_probe=True,
               extra=["--max-steps", str(STOP_AT), "--checkpoint-every", str(CHECKPOINT_EVERY),
                      "--reshard-after-forward", "false"])
    # one step at bf16, one process: the MixedPrecisionPolicy that apply_fsdp gives each unit
    bf16 = Run(ctx.work, "bf16", ctx.script, BATCH, optional=OPTIONAL,
               extra=["--precision", "bf16", "--max-steps", "1"])
    run.wait(), stop.wait()
    resumed = start_resume(ctx, stop)
    restarted = start_restart(ctx, stop)
    ref.wait(), bf16.wait()
    for r in (resumed, restarted):
        if r:
            r.wait()
    if ref.crashed:
        raise RuntimeError(f"the reference run failed: {ref.failure and ref.failure.message}")
    for r in (run, stop):
        if r.crashed:
            report_crash(ctx, r, cause=uneven_saves(r))
            rep.note(f"(full output of the {r.name} run: {r.dir / 'output.txt'})")
            break
    if not run.ranks[0]:
        return
    check_sharding(ctx, run, stop, ref)
    if run.crashed:
        check_imports(ctx, 17, run)
        return
    check_imports(ctx, 17, run)
    sharded = bool(run.ranks[0].get("fsdp"))
    other = rank_with_other_initial_weights(run) if sharded else None
    if other is not None:
        rep.fail(18, f"rank {other} built the model with other initial weights than rank 0, and "
                 "fully_shard keeps each rank's share of its own model (DDP broadcast rank 0's "
                 f"weights; FSDP does not), so the sharded model is a mix of two: {SEED_ALIKE}")
    elif sharded:  # (the DDP script as shipped trains right: nothing to say about it here)
        check_losses(ctx, run, ref, 18)
    if sharded:
        check_bf16_policy(ctx, bf16)
        check_eval_exact(ctx, run, 19, "evaluate like the DDP step (all_reduce_sum of loss_sum "
                         "and tokens), then reshard every FSDP unit")
    check_checkpoints(ctx, run, stop, resumed)
    if other is not None:
        for todo, what in ((21, "the resumed losses are"), (22, "final_model.pt is")):
            rep.waits(todo, f"{what} compared with one process's once every rank builds the "
                      "same model (TODO 18's FIX)")
        return
    check_resume(ctx, stop, resumed, ref)
    check_restart(ctx, restarted, ref)
    if calls(run, "save_full_model"):
        rep.attempt(22)
    if sharded or calls(run, "save_full_model"):
        check_weights_file(ctx, run, ref, 22, "final_model.pt",
                           save_with="save_full_model(model, out_dir / 'final_model.pt')")


def uneven_saves(run) -> str | None:
    """Why a run stopped in a save, when the ranks did not save the same checkpoints in the
    same order (a sharded checkpoint needs every rank: rank 0 alone saving "best" meets the
    other rank's save of "last"). None if they saved alike."""
    saves = [calls(run, "save_sharded_model", rank=r) for r in range(run.geometry.world)]
    names = [[Path(c.get("path") or "?").name for c in s] for s in saves]
    for i in range(max(len(n) for n in names)):
        here = [n[i] if i < len(n) else None for n in names]
        if len(set(here)) > 1:
            r = next(r for r, n in enumerate(here) if n is not None)
            other = next(o for o, n in enumerate(here) if n != here[r])
            doing = f"saves {here[other]}" if here[other] else "saves nothing"
            return (f"rank {r} saves {here[r]} (line {saves[r][i].get('line')}) while rank "
                    f"{other} {doing}: every rank writes its own shards of a checkpoint, so "
                    "every rank calls save_sharded_model for it (not under `if rank == 0:`)")
    return None


def check_bf16_policy(ctx, bf16) -> None:
    """TODO 18 under --precision bf16: every unit gathers bf16 weights and sums its gradients
    in fp32, and the root returns fp32 logits. Losses cannot show it (autocast computes the
    matmuls in bf16 anyway); the traffic, the loss's rounding and evaluation can: a root that
    casts its input to bf16 for blocks that kept fp32 weights stops the first evaluation."""
    rep = ctx.report
    units = bf16.ranks[0].get("fsdp") if bf16.ranks and bf16.ranks[0] else None
    problem = policy_problem(units) if units else None
    calls_made = (bf16.ranks[0] or {}).get("own_calls", {}).get("apply_fsdp", []) \
        if bf16.ranks else []
    if problem and calls_made and not passes_precision(calls_made[0]):
        # apply_fsdp may be right: its caller left the precision to its default
        rep.fail(19, "apply_fsdp is called without the precision, so --precision bf16 "
                 "shards fp32 weights: apply_fsdp(model, args.precision, "
                 "args.reshard_after_forward == 'true')")
    elif problem:
        stopped = bf16.failure.message if bf16.crashed and bf16.failure else ""
        rep.fail(18, problem + (f" (the --precision bf16 run stopped with: {stopped})"
                                if stopped else ""))
    elif bf16.crashed:
        cause = None
        fp32_out = [p for p in (units or {}).get("precision") or [] if p and p[2] == "float32"]
        if fp32_out and "mixed dtype" in (bf16.failure.message if bf16.failure else ""):
            cause = ("the blocks' policy has output_dtype=torch.float32 too: each block hands "
                     "fp32 activations to the root's bf16 final norm, which a CPU cannot mix "
                     "(a GPU's autocast runs norms in fp32 and hides it, for a cast per block); "
                     "give output_dtype to the root only, for the logits")
        report_crash(ctx, bf16, todo=18 if cause else None, cause=cause,
                     prefix="with --precision bf16, ")
        rep.note(f"(full output of the --precision bf16 run: {bf16.dir / 'output.txt'})")
    elif problem == "":  # (None: FSDP's internals did not say, nothing to judge)
        rep.ok(18, "with --precision bf16 every unit gathers bf16 weights and sums gradients in "
               "fp32, and the root returns fp32 logits")


def passes_precision(call) -> bool:
    """Whether a recorded apply_fsdp call of the bf16 run hands on a precision: a second
    argument, a keyword precision=, or the run's bf16 (or a dtype) under a name of its own."""
    others = [*call["args"][1:], *call["kwargs"].values()]
    return len(call["args"]) > 1 or "precision" in call["kwargs"] or any(
        v in ({"str": "bf16"}, {"type": "dtype"}) for v in others)


def policy_problem(units) -> str | None:
    """What is wrong with the units' MixedPrecisionPolicy in a bf16 run, "" where nothing is,
    None where FSDP's internals did not say."""
    if None in units.get("precision", [None]) or not units.get("root_precision"):
        return None
    policies = [*units["precision"], units["root_precision"]]
    policy = ("mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
              "reduce_dtype=torch.float32)")
    # an unset param_dtype gathers the weights' own fp32, an unset reduce_dtype sums in it
    gathered = [p[0] or "float32" for p in policies]
    if any(d != "bfloat16" for d in gathered):
        blocks_right, root_right = set(gathered[:-1]) == {"bfloat16"}, gathered[-1] == "bfloat16"
        which = "the root" if blocks_right else "the blocks" if root_right else "every unit"
        wrong = sorted({d for d in gathered if d != "bfloat16"})
        why = ("twice the traffic of bf16" if wrong == ["float32"] else
               "fp16's small range needs loss scaling, bf16's does not")
        return (f"with --precision bf16 {which} gather{'' if which == 'the blocks' else 's'} "
                f"{' and '.join(map(short_dtype, wrong))} weights ({why}): every fully_shard "
                f"call, blocks and root, takes {policy}")
    if any(p[1] != "float32" for p in policies):
        summed = sorted({p[1] or p[0] or "float32" for p in policies if p[1] != "float32"})
        return (f"with --precision bf16 the gradients are summed in "
                f"{' and '.join(map(short_dtype, summed))} (the policy's reduce_dtype is unset "
                f"or not fp32): many ranks' gradients lose digits; {policy}")
    if units["root_precision"][2] != "float32":
        return ("with --precision bf16 the root returns bf16 logits: the loss over the "
                "vocabulary is computed from rounded logits; the root's policy also takes "
                "output_dtype=torch.float32")
    return ""


def short_dtype(name: str) -> str:
    """fp32, bf16, fp16 for the dtype names FSDP's policies are recorded with."""
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(name, name)


def reshard_given(record) -> list:
    """What each call of apply_fsdp got for reshard_after_forward (a string shows as a dict)."""
    return [c["args"][2] if len(c["args"]) > 2 else c["kwargs"].get("reshard_after_forward")
            for c in (record or {}).get("own_calls", {}).get("apply_fsdp", [])]


def check_sharding(ctx, run, stop, ref) -> None:
    rep = ctx.report
    r0 = run.ranks[0]
    units = r0.get("fsdp")
    given = [c for c in r0.get("own_calls", {}).get("apply_fsdp", [])]
    flag = reshard_given(r0)
    if any(isinstance(f, dict) for f in flag):
        rep.fail(19, f"apply_fsdp gets reshard_after_forward={flag[0].get('str', '?')!r}, a "
                 "string (and the string 'false' counts as true): pass a bool, "
                 "args.reshard_after_forward == 'true'")
        rep.attempt(19)
    if units is not None and r0.get("optimizer_holds_model") is False:
        rep.fail(19, "the optimizer was made before apply_fsdp: it holds the unsharded "
                 "parameters, which fully_shard replaced (DCP then fails with KeyError: 0): "
                 "make the optimizer after sharding")
        rep.attempt(19)
    if r0.get("ddp"):
        rep.fail(19, "the model is still wrapped in DDP: model = apply_fsdp(model, "
                 "args.precision, args.reshard_after_forward == 'true') instead of DDP(...)")
    if units is None:
        if not r0.get("ddp") and not rep.failed(19) and not run.crashed:
            rep.fail(19, "the model is not sharded (no FSDP unit): model = apply_fsdp(...)")
        if "apply_fsdp" in r0.get("defined", []) and not given:
            rep.waits(18, "apply_fsdp is checked once TODO 19 calls it")
        return
    rep.attempt(18)
    rep.attempt(19)
    blocks, root = units["blocks"], units["root"]
    if all(blocks) and root:
        rep.ok(18, f"every block ({len(blocks)}) and the root are FSDP units")
    elif units.get("inner") and not any(blocks):
        rep.fail(18, inner_units(units) + ": fully_shard(block, ...) on every block in "
                 "model.layers.values(), then fully_shard(model, ...)")
    elif root and not any(blocks):
        rep.fail(18, "only the root is sharded, one FSDP unit for the whole model: call "
                 "fully_shard(block, ...) on every block in model.layers.values() before "
                 "fully_shard(model, ...)")
    elif not root:
        rep.fail(18, "the blocks are sharded, but not the root (embeddings, final norm, output "
                 "layer): fully_shard(model, ...) after the blocks")
    else:
        rep.fail(18, f"only some blocks are FSDP units ({blocks}): fully_shard every block")
    if not units["all_dtensor"]:
        rep.fail(18, "some parameters are not sharded: " + ", ".join(units["plain"][:4]))
    parser = r0.get("parser", {})
    if "--reshard-after-forward" in parser.get("missing", []):
        rep.fail(18, "there is no --reshard-after-forward option yet: "
                 "parser.add_argument('--reshard-after-forward', choices=['true', 'false'], "
                 "default='true')")
    elif parser.get("defaults", {}).get("reshard_after_forward", "true") not in ("true", True):
        default = parser["defaults"]["reshard_after_forward"]
        rep.fail(18, f"--reshard-after-forward defaults to {default!r}: a run without the flag "
                 "keeps every block's gathered weights until backward, more memory than "
                 "fully_shard's own default; default='true'")
    else:
        flags = [units.get("reshard_after_forward"),
                 (stop.ranks[0] or {}).get("fsdp", {}) .get("reshard_after_forward")
                 if stop.ranks and stop.ranks[0] and stop.ranks[0].get("fsdp") else None]
        if flags[0] and flags[1] and None not in flags[0] + flags[1]:
            option = ((stop.ranks[0] or {}).get("parser", {}).get("values", {}) or {}).get(
                "reshard_after_forward")
            if any(flags[1]) and option is True:  # the parser itself made True of "false"
                rep.fail(18, "--reshard-after-forward false arrives as True: type=bool makes "
                         "True of any non-empty string; choices=['true', 'false'], "
                         "default='true', and apply_fsdp(..., args.reshard_after_forward == "
                         "'true')")
            elif reshard_given(r0)[:1] == [False] and reshard_given(stop.ranks[0])[:1] == [True]:
                rep.fail(19, "the flag arrives inverted: --reshard-after-forward true gives "
                         "apply_fsdp reshard_after_forward=False, and false gives True: pass "
                         "args.reshard_after_forward == 'true'")
            elif any(flags[1]) and reshard_given(stop.ranks[0])[:1] == [True]:
                # apply_fsdp passes on what it gets; its caller turned "false" into True
                rep.fail(19, "with --reshard-after-forward false, apply_fsdp gets "
                         "reshard_after_forward=True (bool('false') is True: any non-empty "
                         "string is): pass args.reshard_after_forward == 'true'")
            elif not all(flags[0]) or any(flags[1]):
                rep.fail(18, f"--reshard-after-forward true/false gave the blocks "
                         f"reshard_after_forward={flags[0][0]}/{flags[1][0]}: pass "
                         "reshard_after_forward to fully_shard of every block")
    if root and units.get("root_reshard"):
        rep.fail(18, "the root gets reshard_after_forward=True: it frees its weights (the "
                 "embeddings and the output layer) after forward, and backward gathers them "
                 "again at once, one all-gather more per step; pass reshard_after_forward to "
                 "the blocks only and leave it out of fully_shard(model, ...)")
    full = ref.summary["model_state_bytes_per_rank"][0]
    mine = (run.summary or {}).get("model_state_bytes_per_rank") or []
    if mine and max(mine) <= 0.6 * full:
        rep.ok(19, "memory per rank (weights+gradients+optimizer): "
               f"{' '.join(f'{b / 2**20:.2f}' for b in mine)} MiB, {full / 2**20:.2f} MiB in "
               "one process")
    elif mine:
        rep.fail(19, f"each rank holds {max(mine) / 2**20:.2f} MiB of model state, as much as "
                 f"one process ({full / 2**20:.2f} MiB): the optimizer must be made after "
                 "apply_fsdp, from the sharded parameters")
    elif run.crashed and not r0.get("ddp") and units["all_dtensor"]:
        rep.ok(19, "apply_fsdp replaced DDP (the memory per rank is not measured: the run "
               "stopped)")
    evals = r0.get("evals", [])
    kept = [e for e in (stop.ranks[0] or {}).get("evals", []) if not e["resharded"]]
    if (evals and not all(e["resharded"] for e in evals) or kept) \
            and "FSDPModule" in imported_as_other(ctx, 17, run):
        rep.waits(19, "the reshard after evaluate() is checked once FSDPModule is FSDP2's "
                  "class, the one fully_shard's units are (TODO 17's FIX)")
    elif evals and not all(e["resharded"] for e in evals):
        rep.fail(19, "after evaluate() the root's full weights stay gathered on every rank: "
                 "reshard at the end of evaluate(), unit.reshard() for every FSDPModule in "
                 "model.modules()")
    elif kept:
        rep.fail(19, "with --reshard-after-forward false, the blocks' full weights stay "
                 "gathered after evaluate(): reshard() is per FSDP unit and does not reach the "
                 "units inside it; call it on every FSDPModule in model.modules()")


def own_key(state: dict, name: str, record) -> str | None:
    """The key of train_state that holds `name`: the name itself; for what only the script's
    own code reads back, also another key that holds it (best_val: a number that an evaluation
    of the run returned; loss_history: a list of numbers). None if none does."""
    if name in state:
        return name
    if name == "best_val":
        evaluated = [e.get("value") for e in (record or {}).get("evals", [])]
        evaluated = [v for v in evaluated if isinstance(v, float)]

        def holds(v):
            return isinstance(v, float) and any(near(v, e, 1e-9, 0) for e in evaluated)
    elif name == "loss_history":
        def holds(v):
            return isinstance(v, list) and bool(v) and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)
    else:
        return None
    found = [k for k, v in state.items() if k not in TRAIN_STATE and holds(v)]
    # (the best and the last validation loss can be the same number: the best is the one)
    found.sort(key=lambda k: "best" not in k.lower())
    return found[0] if found else None


def start_resume(ctx, stop):
    """Resume the stopped run's last checkpoint in one process, with a best validation loss
    in it that no evaluation can beat, under the key that holds it (None if there is no
    checkpoint to resume)."""
    if stop.crashed:
        return None
    ckpt = stop.out / "checkpoints" / "last"
    state_file = ckpt / "train_state.json"
    if not (ckpt / ".metadata").is_file():
        return None
    if state_file.is_file():
        try:
            state = json.loads(state_file.read_text())
        except ValueError:
            state = None
        if isinstance(state, dict):
            ctx.extra["resume_state"] = dict(state)
            key = ctx.extra["best_key"] = own_key(state, "best_val", stop.ranks[0])
            if key:
                state[key] = UNBEATABLE
                state_file.write_text(json.dumps(state, indent=1) + "\n")
    return Run(ctx.work, "resumed", ctx.script, BATCH * 2, geometry=ONE, optional=OPTIONAL,
               extra=["--resume", str(ckpt)])


def start_restart(ctx, stop):
    """The stopped run started again as torchrun or Slurm restarts it: the same two ranks, the
    same folder with its checkpoints, no --resume (None if there is nothing to restart from)."""
    checkpoints = stop.out / "checkpoints"
    if stop.crashed or not (checkpoints / "last" / ".metadata").is_file():
        return None
    folder = ctx.work / "restarted"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(checkpoints, folder / "out" / "checkpoints")
    return Run(ctx.work, "restarted", ctx.script, BATCH, geometry=TWO_NODES, optional=OPTIONAL,
               env={"TORCHELASTIC_RESTART_COUNT": "1"})


def check_restart(ctx, restarted, ref) -> None:
    """TODO 21 on two ranks and without --resume, judged once the resume in one process is
    right: every rank loads its shards, the global batch is compared, rank 0 alone says so,
    and a restart continues instead of starting at step 0."""
    rep = ctx.report
    if restarted is None or rep.failed(21) or not rep.judged(21):
        return
    how = "restarted on 2 ranks without --resume (as torchrun --max-restarts or a requeued job)"
    # (a rank killed mid-collective leaves no record: the calls of the others tell)
    loading = {r for r in range(restarted.geometry.world) if calls(restarted, "load_sharded_model",
                                                                   rank=r)}
    f = restarted.failure
    if f and f.callee in ("load_sharded_model", "dcp.load", "load"):
        loading.add(f.rank)  # killed inside the load: it had called it
    every_rank = ("every rank loads its own shards: load_sharded_model(...) on every rank, no "
                  "`if rank == 0:` around it")
    if restarted.crashed:
        f = restarted.failure
        cause = ("resume_position compares the global batch: pass global_batch, "
                 "args.batch_size * world_size, not this rank's batch"
                 if f and "global batch" in f.message else every_rank
                 if loading and len(loading) < restarted.geometry.world else None)
        report_crash(ctx, restarted, todo=21, cause=cause, prefix=f"{how}, ")
        rep.note(f"(full output of the restarted run: {restarted.dir / 'output.txt'})")
        return
    if not calls(restarted, "load_sharded_model"):
        rep.fail(21, f"{how}, the run starts again at step 0 and overwrites its checkpoints: "
                 "resume = resume_checkpoint(args.resume, out_dir / 'checkpoints') whether "
                 "or not --resume is given (it turns a restart into the newest checkpoint)")
        return
    if len(loading) < restarted.geometry.world:
        rep.fail(21, f"{how}, only rank(s) {sorted(loading)} load the checkpoint: {every_rank}")
        return
    # (a line that names the checkpoints folder, in any words)
    folder = restarted.out / "checkpoints"
    said = [p["text"] for record in restarted.ranks[1:] if record
            for p in record.get("prints", []) if "resum" in p["text"].lower()
            or str(folder) in p["text"] or str(folder.resolve()) in p["text"]]
    if said:
        rep.fail(21, f"{how}, rank 1 prints too ({said[0][:60]!r}): say where the run resumed "
                 "with print0")
        return
    mine, theirs = restarted.summary["loss_history"], ref.summary["loss_history"]
    i = first_difference(mine, theirs)
    if i is not None or len(mine) != len(theirs):
        at = i if i is not None else min(len(mine), len(theirs))
        rep.fail(21, f"{how}, the losses differ from the uninterrupted run from step {at + 1} "
                 "on: the same run on any number of ranks continues alike (every rank loads, "
                 "the global batch, the position from resume_position)")


def key_not_saved(ctx, resumed) -> str | None:
    """The train_state key the resumed run stopped on (KeyError) that its checkpoint lacks."""
    f = resumed.failure if resumed is not None and resumed.crashed else None
    m = re.search(r"KeyError: '(\w+)'", f.message) if f else None
    state = ctx.extra.get("resume_state")
    return m.group(1) if m and state is not None and m.group(1) not in state else None


def missing_keys_text(state: dict, missing: list, own: dict, unread: str | None) -> str:
    """TODO 20's line for keys train_state lacks: per key, what goes there and what reads it."""
    parts = []
    for key in missing:
        what, reader = TRAIN_STATE[key]
        if key == unread and own.get(key):
            reader = f"your TODO 21 code reads it, and the checkpoint holds it as {own[key]}"
        parts.append(f"no key {key} (= {what}): {reader}")
    others = [k for k in state if k not in TRAIN_STATE and k not in own.values()]
    text = "train_state has " + "; ".join(parts)
    if len(missing) == 1 and len(others) == 1:
        text += f" (it has {others[0]}: name that key {missing[0]})"
    elif others:
        text += f" (it also has: {', '.join(others)})"
    return text


def optimizer_not_saved(resumed) -> bool:
    """The resumed run stopped where DCP found no optimizer state in the checkpoint."""
    f = resumed.failure if resumed is not None and resumed.crashed else None
    return bool(f and "Missing key in checkpoint state_dict: app.optim" in (f.message or ""))


def check_checkpoints(ctx, run, stop, resumed) -> None:
    rep = ctx.report
    if calls(run, "save_sharded_model") or calls(run, "dcp.save"):
        rep.attempt(20)
    folder = run.out / "checkpoints"
    last = folder / "last"
    if not (last / ".metadata").is_file():
        saved0 = [s for s in calls(run, "save_sharded_model", rank=0)]
        saved1 = [s for s in calls(run, "save_sharded_model", rank=1)]
        outside = [s for s in saved0 if s.get("path") and not (
            Path(s["path"]).is_absolute() and Path(s["path"]).is_relative_to(run.out))]
        if outside:
            folder = Path(outside[0]["path"])
            where = "the current folder" if not folder.is_absolute() else str(folder.parent)
            rep.fail(20, f"the checkpoints are saved into {where} ({folder}, line "
                     f"{outside[0].get('line')}), not into the run's folder --out-dir, where "
                     "--resume auto and a restart look for them: save_sharded_model(model, "
                     "optimizer, out_dir / 'checkpoints' / name, train_state)")
        elif saved0 and not saved1:
            rep.fail(20, "only rank 0 calls save_sharded_model: every rank writes its own "
                     "shards, call it on every rank")
        else:
            rep.fail(20, "no checkpoints/last folder with DCP's .metadata: "
                     "save_sharded_model(model, optimizer, out_dir / 'checkpoints' / name, "
                     "train_state) at the end of every epoch")
        return
    state = final_state(run)
    if not state:
        rep.fail(20, "checkpoints/last has no readable train_state.json: save with "
                 "save_sharded_model(model, optimizer, folder, train_state)")
        return
    # best_val and loss_history under names of the script's own are right: its own code reads
    # them back (unless it reads another name: the resumed run's KeyError)
    own = {key: own_key(state, key, run.ranks[0]) for key in OWN_KEYS}
    unread = key_not_saved(ctx, resumed)
    missing = [k for k in TRAIN_STATE if k not in state and not own.get(k) or k == unread]
    global_batch = BATCH * run.geometry.world
    history = state.get(own["loss_history"] or "loss_history")
    if missing:
        ctx.extra["missing_keys"] = missing
        rep.fail(20, missing_keys_text(state, missing, own, unread))
    elif state["global_batch"] != global_batch:
        ctx.extra["wrong_global_batch"] = True
        rep.fail(20, f"train_state says global_batch {state['global_batch']}, the run trains "
                 f"on {global_batch} sequences per step (--batch-size {BATCH} x "
                 f"{run.geometry.world} ranks): global_batch=args.batch_size * world_size, the "
                 "number resume_position compares")
    elif state["step"] != run.summary["steps"] or len(history) != state["step"]:
        rep.fail(20, f"the last checkpoint says step {state['step']} with "
                 f"{len(history)} losses; the run ended at step "
                 f"{run.summary['steps']}")
    elif not (folder / "best" / ".metadata").is_file():
        rep.fail(20, "no checkpoints/best: save_checkpoint('best', ...) where the validation "
                 "loss improves (save0 refuses sharded weights)")
    elif optimizer_not_saved(resumed):
        ctx.extra["optimizer_not_saved"] = True
        rep.fail(20, "the checkpoint holds no optimizer state, so a resumed AdamW would start "
                 "its moments from zero: save_sharded_model(model, optimizer, folder, "
                 "train_state)")
    else:
        rep.ok(20, "checkpoints/last and best are Distributed Checkpoint folders with their "
               "train_state")
    if stop.crashed or not stop.ranks[0]:
        return
    parser = stop.ranks[0].get("parser", {})
    if "--checkpoint-every" in parser.get("missing", []):
        rep.fail(20, "there is no --checkpoint-every option yet (see TODO 20)")
        return
    saves = calls(stop, "save_sharded_model", rank=0)
    # after how many optimizer steps each save came (not the tokens counted so far: the step's
    # throughput.step may come after the save)
    steps = sorted({c["optimizer_steps"] for c in saves})
    wanted = set(range(CHECKPOINT_EVERY, STOP_AT + 1, CHECKPOINT_EVERY))
    if not wanted <= set(steps):
        rep.fail(20, f"with --checkpoint-every {CHECKPOINT_EVERY} checkpoints were saved after "
                 f"steps {steps}, expected also after {sorted(wanted - set(steps))}: "
                 "if args.checkpoint_every and step % args.checkpoint_every == 0: "
                 "save_checkpoint('last', ...) in the training loop")
        return
    last = [c["optimizer_steps"] for c in saves if Path(c.get("path") or "").name == "last"]
    if last and max(last) < STOP_AT and final_state(stop).get("step") != STOP_AT:
        rep.fail(20, f"the run stopped by --max-steps {STOP_AT} saved 'last' for the last "
                 f"time after step {max(last)}: the steps since are lost on a resume; save 'last' where "
                 "the run stops too, before the break at args.max_steps")
        return
    check_saved_positions(ctx, run, saves)


def check_saved_positions(ctx, run, saves) -> None:
    """TODO 20: every checkpoint's train_state says where the run was: the step it was saved
    after, and an epoch and batches_done that resume_position turns back into that step."""
    for c in saves:
        step, epoch, done = c.get("state_step"), c.get("state_epoch"), c.get("state_batches")
        trained = c.get("optimizer_steps")
        if None in (step, epoch, done, trained):
            continue
        if step != trained:
            ctx.report.fail(20, f"a checkpoint saved after {trained} optimizer steps says step "
                            f"{step}: save it after step += 1, with the step just trained")
            return
    wrong = wrong_position(run, saves)
    if wrong:
        ctx.extra["wrong_position"] = True
        ctx.report.fail(20, f"{wrong}. Save the epoch the loop is in and the batches done in "
                        "it, counted before the save")


def wrong_position(run, saves) -> str | None:
    """The first checkpoint whose epoch and batches_done do not lead back to the step it was
    saved after, said in words (None if all do, or the run has no whole epochs to count)."""
    args = run.summary.get("args", {}) if run.summary else {}
    if args.get("max_steps") or not args.get("epochs"):
        return None
    per_epoch = run.summary["steps"] // args["epochs"]  # the uninterrupted run's epochs
    for c in saves:
        step, epoch, done = c.get("state_step"), c.get("state_epoch"), c.get("state_batches")
        if None not in (step, epoch, done) and epoch * per_epoch + done != step:
            return (f"the checkpoint after step {step} says epoch {epoch}, batches_done {done}: "
                    f"a resume would go on at step {epoch * per_epoch + done} ({per_epoch} "
                    "steps per epoch)")
    return None


def check_resume(ctx, stop, resumed, ref) -> None:
    rep = ctx.report
    if stop.crashed:
        return
    if resumed is None:
        if rep.failed(20):
            rep.waits(21, "resuming is checked once the run saves a checkpoint to resume from "
                      "(fix TODO 20 above first)")
        else:
            rep.fail(21, "needs the checkpoints of TODO 20 first")
        return
    r = resumed.ranks[0] or {}
    parser = r.get("parser", {})
    if "--resume" in parser.get("missing", []):
        rep.fail(21, "there is no --resume option yet (see TODO 21)")
        return
    if r.get("loads") or calls(resumed, "load_sharded_model") or calls(resumed, "dcp.load"):
        rep.attempt(21)
    if resumed.crashed:
        f = resumed.failure
        if ctx.extra.get("wrong_global_batch") and f and "global batch" in f.message:
            rep.waits(21, "resume_position refuses the checkpoint's global batch "
                      "(fix TODO 20 above first)")
            return
        if ctx.extra.get("optimizer_not_saved"):
            rep.waits(21, "the checkpoint has no optimizer state to load (fix TODO 20 above "
                      "first)")
            return
        missing = ctx.extra.get("missing_keys") or []
        unread = key_not_saved(ctx, resumed)
        if unread in missing or set(missing) & {"step", "epoch", "batches_done", "global_batch"}:
            rep.waits(21, "the resume reads keys that train_state lacks (fix TODO 20 above "
                      "first)")
            return
        # the uninterrupted runs went through the same lines: what differs is what resuming
        # restored (a missing import aside)
        todo = crash_todo(ctx, f) if f else None
        cause = None
        if f and re.search(r"'(float|int|list|dict)' object has no attribute", f.message):
            cause = ("train_state comes back from JSON, its losses as floats, and the loop's "
                     "code expects tensors: loss_history = [torch.tensor(loss, device=device) "
                     "for loss in train_state['loss_history']]")
        elif unread:
            saved = ", ".join(ctx.extra.get("resume_state") or {})
            cause = (f"the checkpoint's train_state has no key {unread!r} (its keys: {saved}): "
                     "read back the keys that TODO 20 saves")
        report_crash(ctx, resumed, todo=todo if todo == 17 else 21, cause=cause)
        rep.note(f"(full output of the resumed run: {resumed.dir / 'output.txt'})")
        return
    if not (r.get("loads") or calls(resumed, "load_sharded_model")):
        rep.fail(21, "--resume DIR does not load the checkpoint: train_state = "
                 "load_sharded_model(model, optimizer, folder, cfg.to_dict()) on every rank")
        return
    # the check passes a folder; --resume auto and a restart only work through
    # resume_checkpoint
    if not calls(resumed, "resume_checkpoint"):
        rep.fail(21, "--resume is used as the folder itself: resume = resume_checkpoint("
                 "args.resume, out_dir / 'checkpoints'), which also turns --resume auto and a "
                 "torchrun or Slurm restart into the newest checkpoint")
    for c in calls(resumed, "resume_checkpoint", rank=0)[:1]:
        folder, expected = Path(c.get("folder") or "."), resumed.out / "checkpoints"
        if folder.resolve() != expected.resolve():
            shown = "OUT_DIR" if folder.resolve() == resumed.out.resolve() else str(folder)
            rep.fail(21, f"resume_checkpoint looks for the newest checkpoint in {shown}, but "
                     "they are saved in OUT_DIR/checkpoints: --resume auto and a restart would "
                     "start again at step 0; resume_checkpoint(args.resume, out_dir / "
                     "'checkpoints')")
    # the check stops mid-epoch; a checkpoint of an epoch's end needs the right count to move
    # on to the next epoch
    n_train = (r.get("datasets") or [{}])[0].get("len")
    batches = {n_train // (BATCH * 2), -(-n_train // (BATCH * 2))} if n_train else set()
    for c in calls(resumed, "resume_position", rank=0)[:1]:
        given = c.get("batches_per_epoch")
        if isinstance(given, int) and batches and given not in batches:
            rep.fail(21, f"resume_position gets batches_per_epoch={given}, the training "
                     f"DataLoader has {min(batches)} batches per epoch: pass len(train_loader) "
                     "(else a checkpoint saved at an epoch's end resumes inside that epoch)")
    mine, theirs = resumed.summary, ref.summary
    history, ref_history = mine["loss_history"], theirs["loss_history"]
    if ctx.extra.get("wrong_position") and history != ref_history:
        rep.waits(21, "a resume goes on where the checkpoint says the run was (fix TODO 20 "
                  "above first)")
        return
    if mine["steps"] != theirs["steps"]:
        loaded = (r.get("loads") or [{}])[0]
        extra = mine["steps"] - theirs["steps"]
        why = ("it trains the batches of the epoch that the checkpoint had trained already "
               "again: skip them (start_batch from resume_position, itertools.islice)"
               if extra > 0 and extra == loaded.get("batches_done") else
               "continue from the checkpoint's step and epoch: step, start_epoch, start_batch "
               "= resume_position(...)")
        rep.fail(21, f"the resumed run ends at step {mine['steps']}, the uninterrupted one at "
                 f"{theirs['steps']}: {why}")
        return
    if len(history) != mine["steps"] and "loss_history" in ctx.extra.get("missing_keys", []):
        rep.waits(21, "whether the loss history comes back is checked once train_state holds "
                  "it (fix TODO 20 above first)")
        return
    if len(history) != mine["steps"]:
        rep.fail(21, f"the resumed run's summary has {len(history)} losses for {mine['steps']} "
                 "steps: restore loss_history from train_state (as tensors)")
        return
    i = first_difference(history, ref_history)
    if i is not None:
        trained = sum(((r.get("optimizer_calls") or {}).get("backwards_per_step")) or [])
        if i < STOP_AT and trained == theirs["steps"]:
            why = (f"it trained all {trained} steps again, from step 0 with the loaded "
                   "weights: a line after your resume code sets step, best_val or "
                   "loss_history back to where a new run starts; resume after those lines")
        elif i < STOP_AT:
            why = "the restored losses differ from the run that saved them"
        elif i == STOP_AT and set_first(r) != resumed_epoch(ctx):
            first = set_first(r)
            why = (f"the resumed run goes on in epoch {resumed_epoch(ctx)}, but its training "
                   "sampler " + ("was never given an epoch before it" if first is None else
                                 f"was set to epoch {first} first")
                   + ", so it draws another order: call train_sampler.set_epoch(epoch) at the "
                   "start of every epoch, the epoch it is about to train")
        elif i == STOP_AT and near(history[i], ref_history[0], 0.05):
            why = ("the first step after resuming has the loss of an untrained model: load the "
                   "weights (load_sharded_model after wrapping the model)")
        elif i == STOP_AT:
            why = ("the first step after resuming trains on another batch than the "
                   "uninterrupted run: skip the batches the checkpoint had trained on "
                   "(start_batch from resume_position, itertools.islice)")
        else:
            why = ("the first step after resuming is right, the next ones are not: the "
                   "optimizer's state (AdamW's moments) was not restored: load_sharded_model("
                   "model, optimizer, ...)")
        rep.fail(21, f"resumed at step {STOP_AT}, the losses differ from the uninterrupted run "
                 f"from step {i + 1} on ({history[i]:.5f} vs {ref_history[i]:.5f}): {why}")
        return
    ref_last, my_last = ref.out / "checkpoints" / "last", resumed.out / "checkpoints" / "last"
    if (my_last / ".metadata").is_file():
        try:
            key = first_different_tensor(load_checkpoint_state(my_last, mine["model_config"]),
                                         load_checkpoint_state(ref_last, theirs["model_config"]))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - an unreadable checkpoint is the news
            key = f"(unreadable: {(str(e).splitlines() or [type(e).__name__])[0][:100]})"
        if key:
            rep.fail(21, f"after resuming, the final checkpoint differs from the uninterrupted "
                     f"run's in {key}")
            return
    wrong = wrong_position(resumed, calls(resumed, "save_sharded_model", rank=0))
    if wrong:
        rep.fail(21, f"after resuming, {wrong}: count the batches that resuming skips in "
                 "batches_done too (batches_done = start_batch in the epoch resumed), so that "
                 "the next checkpoint says where the run is")
        return
    best_key = ctx.extra.get("best_key")
    new_best = best_key and (resumed.out / "checkpoints" / "best").exists()
    if new_best and final_state(resumed).get(best_key) == UNBEATABLE:
        rep.fail(20, "the resumed run kept the checkpoint's best validation loss (better than "
                 "any it reached) and still saved a new 'best': save 'best' only where the "
                 "validation loss improves, if val_loss < best_val")
    elif new_best:
        rep.fail(21, "the resumed run saved a new 'best' checkpoint although the checkpoint's "
                 f"best validation loss was better: restore best_val from "
                 f"train_state[{best_key!r}]")
        return
    folder = stop.out / "checkpoints" / "last"
    at = (ctx.extra.get("resume_state") or {}).get("step", STOP_AT)
    if not says_where_it_resumed(r, folder, at):
        rep.fail(21, f"the run resumed from checkpoints/last at step {at}, but rank 0 "
                 "printed no line that names that folder and step: say on rank 0 where the run "
                 "resumed from and at which step, print0(f'resumed from {resume} at step "
                 "{step}'): the job's log is all an instructor sees of a restart")
        return
    rep.ok(21, f"one process resumes the 2-rank checkpoint of step {STOP_AT} and ends exactly "
           "like the uninterrupted run (losses, weights, optimizer state"
           + (", best)" if best_key else ")"))
    if not best_key:
        rep.waits(21, "whether the best validation loss comes back is checked once train_state "
                  "holds it (fix TODO 20 above first)")


def resumed_epoch(ctx) -> int | None:
    """The epoch the resumed run goes on in, from the checkpoint it resumed."""
    return (ctx.extra.get("resume_state") or {}).get("epoch")


def set_first(record: dict) -> int | None:
    """The epoch the run first gave its training sampler (the first sampler it made)."""
    return next((epoch for index, epoch in record.get("set_epoch", []) if index == 0), None)


def final_state(run) -> dict:
    """The train_state of the run's last checkpoint ({} if there is none to read)."""
    try:
        state = json.loads((run.out / "checkpoints" / "last" / "train_state.json").read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def says_where_it_resumed(record: dict, folder: Path, step: int) -> bool:
    """A line rank 0 printed names the folder it resumed from and, besides it, the step (the
    facts, in any words)."""
    names = {str(folder), str(folder.resolve())}
    number = re.compile(rf"(?<![\d.]){step}(?!\d|\.\d)")
    return any(name in p["text"] and number.search(p["text"].replace(name, " "))
               for p in record.get("prints", []) for name in names)


HINTS = {
    17: ("FSDP2 replaces DDP, and sharded checkpoints replace save0: import the new pieces.",
         "fully_shard, MixedPrecisionPolicy and FSDPModule from torch.distributed.fsdp; "
         "save_sharded_model, load_sharded_model, save_full_model, resume_checkpoint and "
         "resume_position from utils.checkpointing."),
    18: ("Each call of fully_shard makes one FSDP unit: its parameters are split over the ranks "
         "and gathered only while the unit computes. One unit per Transformer block, then one "
         "for the rest (the root), so only one block is whole at a time.",
         "def apply_fsdp(model, precision, reshard_after_forward): fully_shard(block, "
         "reshard_after_forward=..., mp_policy=MixedPrecisionPolicy(...)) for every block of "
         "model.layers.values(), then fully_shard(model, ...); and a "
         "--reshard-after-forward {true,false} option."),
    19: ("The model is sharded instead of replicated, and the optimizer must be made from the "
         "sharded parameters. Evaluation gathers the weights (the root's, and with "
         "--reshard-after-forward false every block's) and has no backward to free them again.",
         "model = apply_fsdp(model, args.precision, args.reshard_after_forward == 'true') in "
         "place of the DDP line (the optimizer comes after it); at the end of evaluate(): "
         "for unit in model.modules(): if isinstance(unit, FSDPModule): unit.reshard()."),
    20: ("No rank holds the whole model any more: every rank writes its own shards into one "
         "checkpoint folder, together with what a resumed run needs to continue.",
         "save_sharded_model(model, optimizer, folder, train_state) on every rank; train_state "
         "is a dict with the keys step, epoch, batches_done, global_batch (resume_position reads "
         "them), best_val, loss_history (floats) and model_config (cfg.to_dict(), which "
         "load_sharded_model reads). Save 'last' at each epoch end and every --checkpoint-every "
         "steps, 'best' when validation improves."),
    21: ("A resumed run must continue exactly where the saved one stopped: the same weights, "
         "optimizer state, step, position in the data, best validation loss and loss history.",
         "resume_checkpoint(args.resume, out_dir / 'checkpoints') gives the folder (or None); "
         "load_sharded_model(model, optimizer, folder, cfg.to_dict()) on every rank after the "
         "optimizer exists; resume_position(train_state, global_batch, len(train_loader), "
         "args.max_steps) gives step, start_epoch, start_batch."),
    22: ("An ordinary weights file, for inference or sharing, needs the full weights: gather "
         "them (a collective: every rank takes part) and let rank 0 write them.",
         "save_full_model(model, path) on every rank."),
}
