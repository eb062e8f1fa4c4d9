"""Step 4, train/pp_training.py (TODOs 34-40): pipeline parallelism, one stage per rank.

Your script runs as two nodes with one process each (stage index = global rank, so a local
rank in its place shows), with 2 microbatches of 4 (a count and a size that differ, so one in
the other's place shows) and --layers-per-stage given, next to the DDP solution in one process with the same batch. An epoch
is 5 steps: the run trains 7, so that 2 come after an evaluation. The check looks at what every
stage holds, how each calls the schedule, where the logged loss comes from, and the checkpoints
and evaluation.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from selfcheck.compare import near
from selfcheck.runs import TWO_NODES, Run
from selfcheck.steps.common import (SEED_ALIKE, SEQ_LEN, calls, check_eval_reads, check_losses,
                                    check_prints_once, check_tokens, check_training_shards,
                                    check_weights_file, rank_with_other_initial_weights,
                                    report_crash, sampler_records)
from selfcheck.steps.tp import report_lost_import

FILE = "train/pp_training.py"
WHAT = "pipeline parallelism: stages, schedules, DCP"
TODOS = {34: "split_pipeline_stage", 35: "samplers: one replica", 36: "stage and schedules",
         37: "schedule.step", 38: "loss from the last stage", 39: "DCP save",
         40: "evaluation through the pipeline"}
BATCH = 8
MICROBATCHES = 2
# One epoch (5 steps), its evaluation and 2 steps of the next: a step after an evaluation shows
# a stage the evaluation left without gradients, or a model left in eval mode. (Few steps:
# microbatches add up in another order, and Adam amplifies it.)
SHORT = ["--max-steps", "7"]
# The tiny model's 2 blocks split only one way in 2 stages: given the counts all the same, the
# check sees whether split_pipeline_stage receives them (an uneven split on the cluster needs it)
LAYERS_PER_STAGE = "1,1"


def check(ctx) -> None:
    rep = ctx.report
    ref = Run(ctx.work, "reference", ctx.root / "solutions/train/to_distributed_training.py",
              BATCH, extra=SHORT, reference=True)
    run = Run(ctx.work, "yours", ctx.script, BATCH, geometry=TWO_NODES,
              extra=["--microbatches", str(MICROBATCHES), "--schedule", "1f1b",
                     "--layers-per-stage", LAYERS_PER_STAGE, *SHORT])
    ref.wait(), run.wait()
    if ref.crashed:
        raise RuntimeError(f"the reference run failed: {ref.failure and ref.failure.message}")
    records = [r for r in run.ranks if r]
    if len(records) < 2:
        report_crash(ctx, run)
        rep.note(f"(full output: {run.dir / 'output.txt'})")
        return
    n_layers = ref.summary["model_config"]["n_layers"]
    split = check_split(ctx, run, n_layers)
    staged = check_stages(ctx, run)
    check_same_initial_model(ctx, run)
    if any(s["given"].get("num_replicas") == 1 for r in records
           for s in sampler_records(r, "DistributedSampler")):
        rep.attempt(35)
    calls_judged = staged and not ctx.extra.get("pp_crash_explained")
    # an evaluation that stops midway (schedule.eval without target=) reads part of the split
    eval_wrong = staged and check_eval_inputs(ctx, run)
    if records[0].get("datasets") and records[1].get("datasets") and (split or staged or
                                                                        ctx.status.get(35) == "edited"):
        check_training_shards(ctx, run, 35, 35, replicas=1, replica_of=lambda r: 0,
                              made_is_attempt=False, given_as="num_replicas=1, rank=0")
        if in_evaluate(run):  # a rank stopped midway through a split: its reads are partial
            check_eval_samplers(ctx, run)
        elif not (eval_wrong and run.crashed):
            for split in (1, 2):  # validation, then test: the first wrong one is said
                if check_eval_reads(ctx, run, 35, replicas=1, replica_of=lambda r: 0,
                                    made_is_attempt=False, split=split,
                                    given_as="num_replicas=1, rank=0") is False:
                    break
    if calls_judged:
        check_schedule_calls(ctx, run)
    if staged:
        check_broadcasts(ctx, run)
    if run.crashed and not ctx.extra.get("pp_crash_explained") and staged:
        check_eval_crash(ctx, run)
    if run.crashed and ctx.extra.get("pp_crash_explained"):
        rep.note(f"(full output: {run.dir / 'output.txt'})")  # the FIX line above says why
        return
    if run.crashed and rep.failed(34):  # another model than the stages should hold: its
        rep.note(f"(full output: {run.dir / 'output.txt'})")  # crash follows from TODO 34
        return
    if run.crashed:
        if not report_lost_import(ctx, run):  # (all_reduce_mean's import gone before TODO 38)
            report_crash(ctx, run, cause=known_cause(run))
        rep.note(f"(full output: {run.dir / 'output.txt'})")
        return
    if not staged:
        return
    s = run.summary
    # stages that hold the wrong parts compute another model than one process, a training
    # schedule on the summed loss or steps that keep old gradients train another way: every
    # comparison with it can only differ (the FIX line above says why)
    until = None
    if rep.failed(34):
        until = ("once each stage holds its part of the model (TODO 34): until then the "
                 "pipeline computes another model than one process")
    elif ctx.extra.get("pp_training_loss"):
        until = ("once the training schedule takes lm_loss (TODO 36): until then it trains on "
                 "the sums of the microbatches' losses")
    elif ctx.extra.get("pp_training_differs"):
        until = "once the steps train like one process (TODO 37's FIX)"
    elif ctx.extra.get("pp_other_models"):
        until = ("once every stage is cut from the same model (TODO 36's FIX): until then the "
                 "pipeline trains another model than one process")
    elif rep.failed(35):
        until = ("once every stage reads the batches one process reads (TODO 35): until then "
                 "the pipeline trains or evaluates on other data")
    other_model = until is not None
    if other_model:
        if not rep.failed(37):
            rep.waits(37, f"the training is compared with one process's {until}")
        rep.waits(38, f"the logged losses are compared with one process's {until}")
    else:
        logged_right = check_losses(ctx, run, ref, 38, twice=(  # the check runs 2 microbatches
            ": twice the mean, the sum of the microbatches' losses instead of their mean? "
            "(torch.stack(losses).mean())"))
        # the validation after the last step is evaluated apart from the logged losses: equal
        # to one process's, the weights trained like one process whatever the step lines said
        evaluated_right = (near(s["val_loss"], ref.summary["val_loss"])
                           and near(s["test_loss"], ref.summary["test_loss"]))
        if logged_right or evaluated_right:
            rep.ok(37, "schedule.step trains like one process" + (
                "" if logged_right else " (the validation loss after training is one process's)"))
        elif not rep.failed(37):
            rep.fail(37, "the training differs from one process: the first stage passes x, the "
                     "last target=y and losses=losses; the optimizer steps after schedule.step")
    check_tokens(ctx, run, 38, BATCH * SEQ_LEN, "one pipeline trains on one batch per step: "
                 "throughput.step(x.numel())")
    check_prints_once(ctx, run, 38, print_todo_for_line=True)
    evals = [c for r in records for c in r.get("schedule_calls", []) if c["kind"] == "eval"]
    if evals:
        rep.attempt(40)
    check_eval_calls(ctx, run)
    if near(s["val_loss"], ref.summary["val_loss"]) and near(s["test_loss"],
                                                             ref.summary["test_loss"]):
        rep.ok(40, "validation and test losses equal the single-process run")
    elif other_model:
        rep.waits(40, f"the validation and test losses are compared with one process's {until}")
    elif rep.failed(40):
        pass  # the FIX line says what evaluate gives schedule.eval
    elif ctx.extra.get("pp_shared_stage"):
        rep.waits(40, "the losses are compared once TODO 36 gives the evaluation its own stage "
                  "(the steps after an evaluation train differently without one)")
    elif ctx.extra.get("pp_eval_copy"):
        rep.waits(40, "the losses are compared once TODO 36's eval_stage wraps the model that "
                  "trains (a copy evaluates its untrained weights)")
    else:
        hint = ("evaluate(model, loader, device, stage, eval_schedule, args.precision): "
                "schedule.eval through the pipeline, pad the last batch, broadcast loss_sum from "
                "the last stage")
        if evals and near(s["val_loss"], 0.0, 0, 1e-6):
            hint = "the loss sum exists on the last stage only: broadcast it from there"
        elif evals and padded_without_ignore(records):
            hint = ("the padded rows' targets count: pad with pad_batch(x, y, "
                    "loader.batch_size) from utils.data (targets IGNORE_INDEX, tokens 0), so "
                    "that padding samples count neither in the loss nor in the tokens")
        elif evals and (share := real_share(records)) and all(
                near(s[k], ref.summary[k] * f) for k, f in zip(("val_loss", "test_loss"), share,
                                                               strict=True)):
            hint = ("the tokens counted include the padding (the loss is the single-process one "
                    "times real/padded tokens): count only real targets, tokens += (y != "
                    "IGNORE_INDEX).sum()")
        elif evals and near(s["val_loss"] * MICROBATCHES, ref.summary["val_loss"]):
            hint = (f"1/{MICROBATCHES} of it, with {MICROBATCHES} microbatches: the mean of the "
                    "microbatches' loss sums instead of their sum, loss_sum += "
                    "torch.stack(losses).sum()")
        split = "val" if not near(s["val_loss"], ref.summary["val_loss"]) else "test"
        name = {"val": "validation", "test": "test"}[split]
        rep.fail(40, f"{name} loss {s[f'{split}_loss']:.5f}, single process "
                 f"{ref.summary[f'{split}_loss']:.5f}: {hint}")
    if calls(run, "dcp.save"):
        rep.attempt(39)
    in_place = sorted({Path(c["path"]).name for r in run.ranks if r for c in r.get("calls", [])
                       if c["name"] == "dcp.save" and c.get("path")
                       and not Path(c["path"]).name.endswith(".partial")})
    if in_place:  # (atomic_folder gives the ranks .NAME.partial to write into)
        rep.fail(39, f"dcp.save writes straight into {' and '.join(in_place)}: a kill or a full "
                 "disk during the save leaves a half-written folder where the last complete one "
                 f"was; on every rank, with atomic_folder(out_dir / '{in_place[0]}') as folder: "
                 "dcp.save(model.state_dict(), checkpoint_id=folder)")
    if (run.out / "final_model" / ".metadata").is_file():
        if other_model:
            rep.waits(39, f"the saved weights are compared with one process's {until}")
        elif ctx.extra.get("pp_shared_stage"):
            rep.waits(39, "the weights are compared once TODO 36 gives the evaluation its own "
                      "stage (the steps after an evaluation train differently without one)")
        else:
            check_weights_file(ctx, run, ref, 39, "final_model")
        if not (run.out / "best_model" / ".metadata").is_file():
            rep.fail(39, "no best_model folder: dcp.save(model.state_dict(), "
                     "checkpoint_id=out_dir / 'best_model') where validation improves")
        elif not ctx.extra.get("pp_shared_stage") and not other_model:
            if near(s["val_loss"], ref.summary["val_loss"]):
                check_weights_file(ctx, run, ref, 39, "best_model", ref_name="best_model.pt")
            elif ctx.extra.get("pp_eval_copy"):
                rep.waits(39, "best_model is compared with one process's once TODO 36's "
                          "eval_stage wraps the model that trains: the validation losses decide "
                          "which step's weights are saved there")
            else:  # the validation losses choose the step whose weights are the best
                rep.waits(39, "best_model is compared with one process's once the validation "
                          "loss is (TODO 40): it decides which step's weights are saved there")
    else:
        saved_by = sorted({r for r, record in enumerate(run.ranks) if record and any(
            c["name"] == "dcp.save" for c in record.get("calls", []))})
        why = (f" (only rank(s) {saved_by} called dcp.save: every stage saves its own part)"
               if saved_by and len(saved_by) < run.geometry.world else "")
        rep.fail(39, "no final_model folder with DCP's .metadata: on every rank, inside `with "
                 "atomic_folder(out_dir / 'final_model') as folder:`, "
                 f"dcp.save(model.state_dict(), checkpoint_id=folder){why}")


def check_same_initial_model(ctx, run) -> None:
    """Every rank builds the whole model with the same initial weights, as setup() seeded them
    alike; a stage cut from a model of another seed makes a pipeline of another model."""
    other = rank_with_other_initial_weights(run)
    if other is None:
        return
    ctx.extra["pp_other_models"] = True
    ctx.report.fail(36, f"rank {other} built the model with other initial weights than rank 0, "
                    f"so the stages are cut from different models: {SEED_ALIKE}")


def check_split(ctx, run, n_layers) -> bool:
    """What every stage holds. True when the model was split at all."""
    rep = ctx.report
    records = run.ranks
    if any("layers" not in r for r in records):
        return False
    if any(r.get("error") and not all(c.get("returned") for c in
                                      r.get("own_calls", {}).get("split_pipeline_stage", [{}]))
           for r in records):
        rep.attempt(34)  # it stopped midway: what it left is no layout, the crash says why
        return False
    layers = [r["layers"] for r in records]
    if all(l == list(range(n_layers)) for l in layers) and all(
            all(r["parts"].values()) for r in records):
        return False  # not split (yet)
    rep.attempt(34)
    world = len(records)
    want_layers = [list(range(i * n_layers // world, (i + 1) * n_layers // world))
                   for i in range(world)]
    # the stage each rank asked split_pipeline_stage for: the function is judged by what it was
    # asked, the index given to it (TODO 36) by the PipelineStage's
    asked = [split_index(r) for r in records]
    stage_of = [[st["stage_index"] for st in r.get("stages", [])] for r in records]
    other = [(rank, a, st[0]) for rank, (a, st) in enumerate(zip(asked, stage_of, strict=True))
             if a is not None and st and a != st[0]]  # (st[0]: the training's stage)
    if other:
        rank, a, st = other[0]
        rep.fail(36, f"rank {rank} split the model as stage {a} but built PipelineStage "
                 f"{st}: split_pipeline_stage(model, stage_index, num_stages, "
                 "args.layers_per_stage), the stage index from the global rank, as for the "
                 "PipelineStage")
        ctx.extra["pp_crash_explained"] = True
    ignored = [rank for rank, r in enumerate(records) if split_counts(r) is None]
    if ignored and not other:
        rep.fail(36, f"--layers-per-stage {LAYERS_PER_STAGE} never reached split_pipeline_stage "
                 f"(rank {ignored[0]} called it without counts): split_pipeline_stage(model, "
                 "stage_index, num_stages, args.layers_per_stage), so that an uneven split "
                 "(--layers-per-stage 3,5) is the one the stages hold")
    problems = []
    for rank, r in enumerate(records):
        parts = r["parts"]
        stage = asked[rank] if asked[rank] is not None and 0 <= asked[rank] < world else rank
        first, last = stage == 0, stage == world - 1
        if r["layers"] != want_layers[stage] and r["layers"] == list(range(
                len(want_layers[stage]))):
            problems.append(f"stage {stage}'s blocks are named {r['layers']}, expected "
                            f"{want_layers[stage]}: keep the blocks in model.layers and delete "
                            "the others (del model.layers[name]) so that the kept ones keep "
                            "their keys, and the checkpoint keys stay the whole model's")
        elif r["layers"] != want_layers[stage]:
            problems.append(f"stage {stage} holds blocks {r['layers']}, expected "
                            f"{want_layers[stage]}")
        for name in ("tok_emb", "pos_emb"):
            if parts[name] != first:
                problems.append(f"stage {stage} {'lacks' if first else 'keeps'} {name} (only the "
                                "first stage embeds)")
        for name in ("norm", "output"):
            if parts[name] != last:
                problems.append(f"stage {stage} {'lacks' if last else 'keeps'} {name} (only the "
                                "last stage has the final norm and output layer)")
    stage_of = [st[0] for st in stage_of if st]  # (training's and evaluation's: one index)
    if len(stage_of) == world and stage_of != list(range(world)):
        return True  # the stage index is wrong (TODO 36): the split follows from it
    if problems:
        rep.fail(34, "; ".join(problems[:2]))
    else:
        rep.ok(34, "rank 0 holds the embeddings and the first half of the blocks, rank 1 the "
               "rest, the final norm and the output layer")
    return True


def known_cause(run) -> str | None:
    """What usually causes an error of this step's code (None: the common causes)."""
    f = run.failure
    message = f.message if f else ""
    if "changed size during iteration" in message:
        return ("a loop over model.layers cannot delete from it as it goes: loop over a copy "
                "of its names (for name in list(model.layers))")
    if in_evaluate(run) and not any(script_calls(r, "eval") for r in run.ranks if r):
        # evaluate runs the model itself: a stage's part gets what the whole model would
        return ("evaluate still runs model(x) itself, so the tokens reach a stage without the "
                "embeddings: evaluate through the pipeline, schedule.eval(...) inside "
                "evaluate(model, loader, device, stage, eval_schedule, args.precision)")
    return None


def in_evaluate(run) -> bool:
    """A rank stopped inside the script's evaluate (on its own, or waiting there)."""
    f = run.failure
    return bool(f) and any(fr.get("func") == "evaluate" for p in (f, *f.peers)
                           for fr in p.frames)


def check_eval_samplers(ctx, run) -> None:
    """TODO 35 for a run that stopped inside evaluate (the samples read are partial): the
    evaluation samplers' arguments, where they were given."""
    for rank, r in enumerate(run.ranks):
        for s in sampler_records(r):
            given = s["given"]
            if s["dataset"] in (1, 2) and (given.get("num_replicas", 1) != 1
                                           or given.get("rank", 0) != 0):
                ctx.report.fail(35, f"rank {rank}'s evaluation sampler has num_replicas="
                                f"{given.get('num_replicas')}, rank={given.get('rank')}: the "
                                "stages of a pipeline are one replica, DistributedEvalSampler("
                                "val_ds, num_replicas=1, rank=0), the same for test")
                return


def split_index(record) -> int | None:
    """The stage index the rank gave split_pipeline_stage (its second argument)."""
    calls = record.get("own_calls", {}).get("split_pipeline_stage", [])
    if not calls:
        return None
    args, kwargs = calls[0]["args"], calls[0]["kwargs"]
    index = args[1] if len(args) > 1 else kwargs.get("stage_index")
    return index if isinstance(index, int) and not isinstance(index, bool) else None


def split_counts(record):
    """What the rank gave split_pipeline_stage for layers_per_stage (its fourth argument): None
    when it gave nothing, False when it never called the function."""
    calls = record.get("own_calls", {}).get("split_pipeline_stage", [])
    if not calls:
        return False
    args, kwargs = calls[0]["args"], calls[0]["kwargs"]
    return args[3] if len(args) > 3 else kwargs.get("layers_per_stage")


def check_stages(ctx, run) -> bool:
    rep = ctx.report
    records = run.ranks
    stages = [r.get("stages", []) for r in records]
    # the schedules the script built (not the one the course builds to draw the theory's)
    schedules = [[s for s in r.get("schedules", []) if not s.get("by_course")] for r in records]
    if not any(stages):
        if records[0].get("ddp") and ctx.status.get(36) == "edited":
            rep.fail(36, "DDP still wraps the model: a pipeline stage replaces it")
        return False
    if any(r.get("error") and not st for r, st in zip(records, stages, strict=True)):
        return False  # a rank stopped before it built its stage: the crash says where
    rep.attempt(36)
    problems = []
    stage_of = [st[0]["stage_index"] for st in stages if st]  # the training's stage
    if len(stage_of) == len(records) and stage_of != list(range(len(records))):
        problems.append(f"the ranks built stages {stage_of}: PipelineStage(model, stage_index, "
                        "num_stages, device) with stage_index = the global rank (LOCAL_RANK is "
                        "0 on every node)")
    for rank, (st, sc) in enumerate(zip(stages, schedules, strict=True)):
        if problems:
            break
        if (len(st) not in (1, 2) or len({s["stage_index"] for s in st}) != 1
                or any(s["num_stages"] != len(records) for s in st)):
            problems.append(f"rank {rank} built {len(st)} PipelineStage(s) (stages "
                            f"{[s['stage_index'] for s in st]} of "
                            f"{[s['num_stages'] for s in st]}): one for training and one for "
                            "evaluation, both PipelineStage(model, stage_index, num_stages, "
                            "device)")
            break
        train, evaluation = built_schedules(records[rank])
        if train is None or train["kind"] != "Schedule1F1B":
            kinds = sorted({s["kind"] for s in sc})
            problems.append(f"--schedule 1f1b built {kinds or 'no schedule'}: "
                            "build_schedule(args.schedule, stage, args.microbatches, lm_loss)")
            break
        if train["microbatches"] != MICROBATCHES:
            problems.append(f"--microbatches {MICROBATCHES} (of {BATCH // MICROBATCHES} "
                            f"sequences each) built a schedule of "
                            f"{train['microbatches']} microbatches: "
                            "build_schedule(args.schedule, stage, args.microbatches, lm_loss), "
                            "the number of microbatches, not their size")
            break
        if not train["loss_fn"]:
            problems.append(f"rank {rank}'s training schedule has no loss_fn: torch runs no "
                            "backward for a schedule without one, so this stage never sends "
                            "or receives gradients; build_schedule(args.schedule, stage, "
                            "args.microbatches, lm_loss) on every rank (only the last stage "
                            "calls it)")
            ctx.extra["pp_crash_explained"] = True
            break
        if train["loss_fn"] == "lm_loss_sum":
            problems.append("the training schedule sums the losses of a microbatch "
                            "(lm_loss_sum): build_schedule(args.schedule, stage, "
                            "args.microbatches, lm_loss), the mean, as one process trains on; "
                            "lm_loss_sum is the evaluation's (evaluate divides its sums by the "
                            "tokens)")
            ctx.extra["pp_training_loss"] = True
            break
        if evaluation is None or evaluation["loss_fn"] != "lm_loss_sum":
            problems.append("no evaluation schedule: eval_schedule = build_schedule('gpipe', "
                            "eval_stage, args.microbatches, lm_loss_sum) (it sums, evaluate "
                            "divides)" if evaluation is None else
                            f"the evaluation schedule's loss_fn is {evaluation['loss_fn']}: "
                            "eval_schedule = build_schedule('gpipe', eval_stage, "
                            "args.microbatches, lm_loss_sum) (it sums, evaluate divides)")
            break
        shared = evaluation.get("stage")
        if shared is not None and shared == train.get("stage"):
            problems.append("eval_schedule runs on the training's stage: give it its own, "
                            "eval_stage = PipelineStage(model, stage_index, num_stages, device) "
                            "(a schedule prepares its stage at its first call: the first "
                            "evaluation prepares a shared one for forward only, and every stage "
                            "but the last trains on zero gradients after it)")
            ctx.extra["pp_shared_stage"] = True
            break
        if len({s.get("module") for s in st}) > 1:
            problems.append(f"rank {rank}'s stage and eval_stage wrap different modules: "
                            "both PipelineStage(model, stage_index, num_stages, device) around "
                            "the one model the optimizer trains, not a copy (a copy keeps the "
                            "weights it was made with: its stage runs the untrained model)")
            ctx.extra["pp_eval_copy"] = True
            break
    summary = run.summary or {}
    if not problems and not run.crashed and not summary.get("idle_fraction_per_stage"):
        problems.append("no idle share measured: timer = StageBusyTimer(stage, device), "
                        "timer.start_step() before schedule.step and "
                        "idle_history.append(timer.idle_fraction()) after it")
    idle = summary.get("idle_fraction_per_stage") or []
    if not problems and idle and min(idle) > 0.999:
        # no computation recorded inside a timed step: the timer wraps a stage that does not
        # train, or its step starts after schedule.step
        timer = re.search(r"StageBusyTimer\(\s*(\w+)", ctx.text)
        if timer and timer.group(1) != "stage":
            problems.append(f"the idle share is 100 % on every stage: the timer wraps "
                            f"{timer.group(1)}, which does not train; StageBusyTimer(stage, "
                            "device), the training stage")
        else:
            start = re.search(r"\.start_step\(", ctx.text)
            line = ctx.text.count("\n", 0, start.start()) + 1 if start else None
            rep.fail(ctx.todo_of(line) if line and ctx.todo_of(line) in rep.names else 37,
                     "the idle share is 100 % on every stage: the timer recorded no computation "
                     "in a training step; timer.start_step() right before schedule.step, "
                     "idle_history.append(timer.idle_fraction()) right after it")
    if problems:
        rep.fail(36, problems[0])
    elif not rep.failed(36):
        evaluation = built_schedules(records[0])[1]
        rep.ok(36, f"{len(records)} stages, a 1F1B schedule for training and "
               f"a {evaluation['kind'].removeprefix('Schedule')} one for evaluation, each on its "
               "own PipelineStage"
               + (f"; measured idle share per stage {' '.join(f'{f:.0%}' for f in idle)}"
                  if idle and min(idle) <= 0.999 else ""))
    return True


def script_calls(record, kind) -> list[dict]:
    """The script's own schedule.step or schedule.eval calls (not the steps torch's eval runs
    inside, nor the course's drawing of the schedule)."""
    return [c for c in record.get("schedule_calls", []) if c["kind"] == kind
            and not c.get("by_course") and not c.get("inside_eval")]


def built_schedules(record) -> tuple[dict | None, dict | None]:
    """(training, evaluation) schedule of a rank: the ones its schedule.step and schedule.eval
    ran on, else (not called yet) the first and the second it built. The evaluation schedule is
    one other than the training's: evaluate given the training schedule is TODO 40's."""
    built = record.get("schedules", [])
    own = [i for i, s in enumerate(built) if not s.get("by_course")]

    def used(kind, other=None):
        found = [c.get("schedule") for c in script_calls(record, kind)]
        return next((i for i in found if i in own and i != other), None)
    train = used("step")
    train = train if train is not None else (own[0] if own else None)
    evaluation = used("eval", train)
    if evaluation is None:
        evaluation = next((i for i in own if i != train), None)
    return (built[train] if train is not None else None,
            built[evaluation] if evaluation is not None else None)


def check_schedule_calls(ctx, run) -> None:
    rep = ctx.report
    steps = [(rank, c) for rank, r in enumerate(run.ranks) for c in script_calls(r, "step")]
    if not steps:
        text = "the loop still runs the model itself: schedule.step(...) runs the pipeline"
        if ctx.status.get(37) == "not started":
            rep.needed(37, f"the stages are built (TODO 36), but {text}")
        else:
            rep.fail(37, f"schedule.step is never called: {text}")
        return
    rep.attempt(37)
    last = len(run.ranks) - 1
    for rank, c in steps:
        if rank == 0 and c["args"] != 1:
            rep.fail(37, "the first stage must pass the tokens: schedule.step(x, ...)")
            return
        # (inputs given to a later stage too are not wrong: torch uses the activations it
        # receives there, and the training shows whether it trains like one process)
        if rank == last and not (c["target"] and c["losses"]):
            rep.fail(37, "the last stage must pass target=y and losses=losses (a list that "
                     "receives the microbatch losses)")
            return
    # every stage holds its own part of the weights: each steps its optimizer, and zeroes the
    # gradients first (the schedule adds to what .grad holds)
    counts = [r.get("optimizer_calls") or {} for r in run.ranks]
    idle = [rank for rank, (r, n) in enumerate(zip(run.ranks, counts, strict=True))
            if script_calls(r, "step") and not n.get("steps")]
    if idle and (len(idle) < len(run.ranks) or not run.crashed):
        rep.fail(37, f"stage {' and '.join(map(str, idle))} never called optimizer.step(): "
                 "every stage steps its own optimizer after schedule.step (each holds its own "
                 "part of the weights)")
        ctx.extra["pp_crash_explained"] = run.crashed  # (the ranks then wait apart)
        ctx.extra["pp_training_differs"] = True
        return
    wrong_dtype = autocast_not_the_runs(run)
    if wrong_dtype:
        rep.fail(37, wrong_dtype)
        ctx.extra["pp_training_differs"] = True
        return
    if any(n.get("zero_grads_after_schedule") for n in counts):
        rep.fail(37, "the gradients are zeroed after schedule.step, before optimizer.step "
                 "(which then has no gradients to step with): move optimizer.zero_grad("
                 "set_to_none=True) before schedule.step (the schedule runs the backward "
                 "passes itself)")
        ctx.extra["pp_training_differs"] = True
        return
    if any(n.get("steps", 0) >= 2 and not n.get("zero_grads") for n in counts):
        rep.fail(37, "optimizer.zero_grad() is never called: optimizer.zero_grad("
                 "set_to_none=True) before schedule.step (the schedule adds this step's "
                 "gradients to those .grad holds: without it every step trains on the sum of "
                 "the gradients of all steps so far)")
        ctx.extra["pp_training_differs"] = True


def autocast_not_the_runs(run) -> str | None:
    """schedule.step under an autocast of another dtype than the run's --precision (a
    precision written out, autocast("bf16", device)), said as its FIX line."""
    precision = (run.summary or {}).get("precision")
    for rank, r in enumerate(run.ranks):
        steps = [c for c in script_calls(r or {}, "step") if "autocast" in c]
        dtype = steps[0]["autocast"][1] if steps else None
        if dtype and precision and dtype != {"bf16": "bfloat16"}.get(precision):
            return (f"rank {rank} runs schedule.step under autocast in {dtype} in a run with "
                    f"--precision {precision}: autocast(args.precision, device), the precision "
                    "the run was given")
    return None


def check_broadcasts(ctx, run) -> None:
    """TODOs 38 and 40: a broadcast that every rank calls with its own src (each waits for
    another sender), or whose result (None) replaces the tensor it filled."""
    rep = ctx.report
    records = [r for r in run.ranks if r]
    sent = [[c for c in r.get("calls", []) if c["name"] == "dist.broadcast"] for r in records]
    for same in zip(*sent):
        srcs = [c.get("src") for c in same]
        if len({c["line"] for c in same}) == 1 and len(set(map(str, srcs))) > 1:
            line = same[0]["line"]
            each = ", ".join(f"rank {r} src={src}" for r, src in enumerate(srcs))
            rep.fail(ctx.todo_of(line) or 38, f"every rank calls dist.broadcast at line {line}, "
                     f"each with another src ({each}): src names the one rank that sends, the same on every rank: "
                     "src=num_stages - 1, the last stage, which holds the loss")
            ctx.extra["pp_crash_explained"] = run.crashed
            return
    f = run.failure
    if not run.crashed or not f or "NoneType" not in f.message:
        return
    try:
        tree = ast.parse(ctx.text)
    except SyntaxError:
        return
    lines = {c["line"] for r in records for c in r.get("calls", [])
             if c["name"].startswith("dist.")}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and isinstance(node.targets[0], ast.Name)):
            continue
        func = node.value.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name in ("broadcast", "all_reduce", "reduce") and any(
                node.lineno <= line <= node.end_lineno for line in lines):
            target = node.targets[0].id
            rep.fail(ctx.todo_of(node.lineno) or 38, f"line {node.lineno} makes {target} None "
                     f"(line {f.line} stopped on it: {f.message[:80]}): dist.{name} works in place, it fills the tensor "
                     "it is given and returns None; call it without assigning its result, "
                     f"dist.{name}({target}, ...)")
            ctx.extra["pp_crash_explained"] = True
            return


def check_eval_inputs(ctx, run) -> bool:
    """TODO 40: evaluate runs the evaluation schedule, given what schedule.step is given. True
    when it is not (a FIX line says what to change)."""
    rep = ctx.report
    last = len(run.ranks) - 1
    for rank, r in enumerate(run.ranks):
        train = built_schedules(r)[0]
        built = r.get("schedules", [])
        for c in script_calls(r, "eval"):
            on = built[c["schedule"]] if c.get("schedule") is not None else None
            if on is not None and on is train:
                text = ("evaluate runs the training schedule: evaluate(model, loader, device, "
                        "stage, eval_schedule, args.precision), for validation and test "
                        f"(the training schedule's {train['loss_fn']} averages and is prepared "
                        "for training; eval_schedule's lm_loss_sum sums, evaluate divides)")
            elif rank == 0 and c["args"] != 1:
                text = ("the first stage must pass the tokens: schedule.eval(x, ...) on the "
                        "first stage, as in schedule.step")
            elif rank == last and not c["target"]:
                text = ("the last stage must pass the targets: schedule.eval(..., target=y if "
                        "stage.is_last else None, losses=losses) (the loss_fn gets them)")
            elif rank == last and not c["losses"]:
                text = ("the last stage must pass losses=losses to schedule.eval: the "
                        "microbatch losses land in that list, loss_sum adds them up (without "
                        "it, it stays 0)")
            else:
                continue
            rep.attempt(40)
            rep.fail(40, text)
            if run.crashed:
                ctx.extra["pp_crash_explained"] = True  # the evaluation stopped midway
            return True
    return False


def check_eval_crash(ctx, run) -> None:
    """TODO 40: a stage before the last whose validation loss is not finite (stop_if_not_finite
    stopped it) while the last stage's was: evaluate returns another loss on that stage."""
    f = run.failure
    m = re.search(r"validation loss is (inf|nan)", f.message if f else "")
    if not m or f.rank is None or f.rank == len(run.ranks) - 1:
        return
    what = {"inf": "counted no tokens: count them on every stage (tokens += (y != "
                   "IGNORE_INDEX).sum() outside `if losses:`, every stage has y)",
            "nan": "has neither the loss sum nor the tokens: broadcast loss_sum from the last "
                   "stage, and count the tokens on every stage (outside `if losses:`)"}
    ctx.report.fail(40, f"stage {f.rank}'s validation loss is {m.group(1)}, the last stage's "
                    f"is not: evaluate must return the same loss on every stage; stage {f.rank} "
                    f"{what[m.group(1)]}")
    ctx.extra["pp_crash_explained"] = True


def check_eval_calls(ctx, run) -> None:
    """TODO 37: schedule.step under autocast; TODO 40: schedule.eval under the same autocast,
    and training mode after."""
    rep = ctx.report
    for rank, r in enumerate(run.ranks):
        calls = [c for c in r.get("schedule_calls", [])
                 if not c.get("by_course") and not c.get("inside_eval")]
        steps = [c for c in calls if c["kind"] == "step" and "autocast" in c]
        evals = [c for c in calls if c["kind"] == "eval" and "autocast" in c]
        if steps and not steps[0]["autocast"][0]:  # (the course's autocast, whatever dtype)
            rep.fail(37, f"rank {rank} runs schedule.step outside any autocast: keep "
                     "schedule.step inside the with autocast(args.precision, device): block "
                     "(on a GPU it computes in bf16 there, as schedule.eval does)")
            return
        if steps and evals and any(c["autocast"] != steps[0]["autocast"] for c in evals) \
                and not autocast_not_the_runs(run):  # (then training's is the FIX)
            ev = next(c["autocast"] for c in evals if c["autocast"] != steps[0]["autocast"])
            rep.fail(40, f"rank {rank} runs schedule.eval {describe_autocast(ev)}, "
                     f"schedule.step {describe_autocast(steps[0]['autocast'])}: with "
                     "autocast(precision, device): around schedule.eval too (so that it "
                     "evaluates in the dtypes it trains in: bf16 on a GPU)")
            return
        first_eval = next((i for i, c in enumerate(calls) if c["kind"] == "eval"), None)
        if first_eval is not None and any(c["kind"] == "step" and not c.get("training", True)
                                          for c in calls[first_eval:]):
            rep.fail(40, f"rank {rank} trains in eval mode after an evaluation: model.train() "
                     "at the end of evaluate")
            return


def padded_without_ignore(records) -> bool:
    """The last stage's evaluation batches all have the full batch's rows (the short last ones
    padded), yet none of their targets is IGNORE_INDEX: the padding's targets count."""
    given = [c["targets"] for c in records[-1].get("schedule_calls", [])
             if c["kind"] == "eval" and not c.get("by_course") and c.get("targets")]
    short = any(ln["dataset_len"] % BATCH for ln in eval_loaders(records[-1]))
    return bool(given) and short and all(rows == BATCH and not ignored
                                         for rows, ignored in given)


def eval_loaders(record) -> list[dict]:
    """The validation and the test loader's sizes: [{"dataset_len": ...}, ...]."""
    datasets = record.get("datasets", [])
    return [{"dataset_len": datasets[ld["dataset"]]["len"]} for ld in record.get("loaders", [])
            if ld.get("sampler_type") == "DistributedEvalSampler"
            and isinstance(ld.get("dataset"), int) and ld["dataset"] < len(datasets)]


def real_share(records) -> tuple[float, float] | None:
    """(validation, test): the share of real samples among the padded batches' samples."""
    sizes = [ld["dataset_len"] for ld in eval_loaders(records[-1])]
    if len(sizes) != 2:
        return None
    return tuple(n / (-(-n // BATCH) * BATCH) for n in sizes)


def describe_autocast(state) -> str:
    open_, dtype = state
    if dtype:
        return f"under autocast in {dtype}"
    return "under autocast(...)" if open_ else "outside any autocast"


HINTS = {
    34: ("Each rank keeps only its stage: its blocks, the embeddings on the first stage, the "
         "final norm and output layer on the last. Checkpoint keys keep their names.",
         "split_pipeline_stage(model, stage_index, num_stages, layers_per_stage): keep "
         "stage_layers(...)[stage_index], del model.layers[name] for the others, set "
         "tok_emb/pos_emb (not first) and norm/output (not last) to None."),
    35: ("All stages of one pipeline work on the same batches (the first uses the tokens, the "
         "last the targets): the pipeline is one data-parallel replica.",
         "num_replicas=1, rank=0 in the three samplers."),
    36: ("A PipelineStage sends and receives the activations; a schedule runs the microbatches "
         "through the stages; a timer measures the bubble.",
         "split_pipeline_stage(...), PipelineStage(model, stage_index, num_stages, device), "
         "build_schedule(args.schedule, stage, args.microbatches, lm_loss); for evaluation a "
         "stage of its own, eval_stage = PipelineStage(...), and build_schedule('gpipe', "
         "eval_stage, ..., lm_loss_sum); StageBusyTimer(stage, device)."),
    37: ("The schedule runs forward, loss and backward for all microbatches: the first stage "
         "gives it the tokens, the last the targets and a list for the losses. The gradients "
         "are zeroed before it, since it runs the backward passes itself.",
         "optimizer.zero_grad(set_to_none=True) first; then, inside the with autocast(...) "
         "block, schedule.step(*((x,) if stage.is_first else ()), target=y if stage.is_last "
         "else None, losses=losses), between timer.start_step() and "
         "idle_history.append(...)."),
    38: ("Only the last stage computes the loss: take it from there, and count one batch's "
         "tokens per step (one pipeline, one batch).",
         "torch.stack(losses).detach().mean() on the last stage, dist.broadcast(step_loss, "
         "src=num_stages - 1); throughput.step(x.numel())."),
    39: ("No rank holds the whole model: every stage writes its part of one checkpoint folder, "
         "whose keys are the whole model's.",
         "On every rank: with atomic_folder(out_dir / 'best_model') as folder: "
         "dcp.save(model.state_dict(), checkpoint_id=folder) (and 'final_model'); the folder "
         "appears only once every stage has written its part."),
    40: ("Evaluation runs through the pipeline too (forward only), with a fixed batch shape; "
         "the sums exist on the last stage.",
         "evaluate(model, loader, device, stage, schedule, precision): pad a short batch "
         "with pad_batch(x, y, loader.batch_size) from utils.data, schedule.eval(...) under "
         "autocast(precision, device) as in training, then dist.broadcast(loss_sum, src=last "
         "stage)."),
}
