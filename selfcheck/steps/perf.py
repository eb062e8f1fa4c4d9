"""The performance step, train/perf_training.py (TODOs 41-47, 59-63): measure, profile, fix.

Four runs of your script: two ranks with --profile, on two nodes of one process each (fp32,
vocabulary unpadded, next to the solution in one process), one process in bf16 with --compile --compile-mode max-autotune and
the default padding (compiling is recorded, not done: it takes minutes on a CPU), and one
process with --profile --max-steps 1 (too short to profile: it must say so and train). What only
a GPU shows is read from what your code builds: the compile calls and their mode, whether one
process wraps DDP, and gpu_busy (TODO 59) on a stand-in profile of a GPU busy 6 of 10 ms.
What the runs' lengths do not show is asked in-process too: profiler_window (TODO 43) for runs
of 1 to 12 steps and for long ones. Every run divides by a peak of 2.5e10 FLOP/s per device
(PEAK_FLOPS), so the check can recompute every tokens/s and MFU your step lines print:
MFU = tokens/s x FLOPs per token / (peak x devices), the FLOPs per token from the model's own
count of its matmuls' weights (the embedding tables are lookups: on the check's vocabulary of 42
words they would change MFU by 3 % only, so the parameters counted are compared).
"""

from __future__ import annotations

import json
import math
import re
import statistics

from selfcheck import standin
from selfcheck.compare import lists_close, near
from selfcheck.runs import ONE_NODE_TWO, PEAK_FLOPS, SEQ_LEN, TWO_NODES, Run
from selfcheck.steps.common import check_imports, crash_todo, report_crash

FILE = "train/perf_training.py"
WHAT = ("one GPU fast: tokens/s and MFU, profiler, bf16, fused AdamW, compile; GPU busy, "
        "padded vocabulary, compiled loss, no DDP for one process, CUDA graphs")
TODOS = {41: "imports", 42: "tokens/s and MFU", 43: "profiler", 44: "named ranges",
         45: "precision", 46: "fused AdamW", 47: "compile", 59: "is the GPU waiting",
         60: "padded vocabulary", 61: "the loss compiled", 62: "no DDP for one process",
         63: "CUDA graphs"}
BATCH = 4
OPTIONAL = {"--profile": 0, "--pad-vocab": 1, "--compile-mode": 1}
PAD = 64  # the default of --pad-vocab
RATE = re.compile(r"([\d.,]+(?:e[+-]?\d+)?)\s*(k|K|M)?\s*(?:tokens|tok)\s*/\s*s", re.I)
# MFU in %, or without the sign (group 3): a fraction ("MFU 0.101", {mfu:.3f}) or a
# percentage ("MFU(%) 10.12")
MFU = re.compile(r"MFU\W{0,4}([\d.]+(?:e[+-]?\d+)?)\s*%|([\d.]+)\s*%\s*MFU|"
                 r"MFU\W{0,4}(\d*\.?\d+(?:e[+-]?\d+)?)(?![\d.%]|\s*%)", re.I)
STEP = re.compile(r"\bstep\s*(\d+)\b", re.I)
FLOPS = re.compile(r"([\d.]+(?:e[+-]?\d+)?)\s*([kMGTP]?)FLOP/?s", re.I)
PHASES = {"forward": ("forward", "fwd", "model(", "logits", "loss_fn"),
          "backward": ("backward", "bwd"),
          "optimizer": ("optim", "adam", "update", "sgd"), "communication": ("comm", "all_reduce", "allreduce",
                                                      "reduce")}


# A mode other than the lesson's reduce-overhead: a mode written into the file, or a branch for
# reduce-overhead alone, then compiles in another mode than the one asked for (TODO 63).
COMPILE_MODE = "max-autotune"
# what the runs give instead where the script's --compile-mode offers fewer modes
MODE_FALLBACK = {"CHECK_FLAG_FALLBACKS": "--compile-mode=reduce-overhead"}
# seconds added to each evaluation of the "yours" run (selfcheck/probe.py): the first report
# after it must not count them (TODO 42)
EVAL_PAUSE = 0.6


def check(ctx) -> None:
    rep = ctx.report
    # fp32 runs with the vocabulary unpadded: a padded one draws other initial weights, and a
    # TODO 60 not done yet must not look like a wrong TODO 45
    ref = Run(ctx.work, "reference", ctx.root / "solutions" / FILE, BATCH * 2, reference=True,
              extra=["--pad-vocab", "1"])
    # two nodes of one process each: DDP is needed where there are two processes, whatever
    # each node holds (a test of LOCAL_WORLD_SIZE or the GPUs of a node misses it, TODO 62)
    run = Run(ctx.work, "yours", ctx.script, BATCH, geometry=TWO_NODES,
              extra=["--profile", "--pad-vocab", "1"], optional=OPTIONAL,
              env={"CHECK_EVAL_PAUSE": str(EVAL_PAUSE), "CHECK_PROFILER_WINDOWS": "1"})
    fast = Run(ctx.work, "bf16", ctx.script, BATCH * 2, optional=OPTIONAL, env=MODE_FALLBACK,
               extra=["--precision", "bf16", "--compile", "--compile-mode", COMPILE_MODE,
                      "--max-steps", "6", "--pad-vocab", "1"])
    # the one-step run keeps the default padding, and compiles (recorded: is the loss's used?)
    short = Run(ctx.work, "one step", ctx.script, BATCH * 2, optional=OPTIONAL,
                extra=["--profile", "--max-steps", "1", "--compile"])
    # a stand-in GPU (selfcheck/standin.py): the default --precision auto, a report every
    # second step
    # (--compile-mode without --compile: nothing may be compiled, TODO 63)
    gpu = Run(ctx.work, "stand-in gpu", ctx.script, BATCH, geometry=ONE_NODE_TWO, gpu=True,
              optional=OPTIONAL, env=MODE_FALLBACK, extra=["--profile", "--max-steps", "8", "--log-every", "2",
                                        "--compile-mode", COMPILE_MODE])
    for r in (ref, run, fast, short, gpu):
        r.wait()
    if ref.crashed:
        raise RuntimeError(f"the reference run failed: {ref.failure and ref.failure.message}")
    for r in (run, fast):
        if r.crashed:
            if r is run and r.failure and crash_todo(ctx, r.failure) == 59 and r.ranks[0]:
                check_gpu_busy(ctx, run, profiling=False)  # what it returned says more
            if profiler_after_stop(ctx, r):
                report_crash(ctx, r, todo=43, cause=(
                    "the profiler is stepped after profiler.stop(), which PyTorch's profiler "
                    "does not survive: stop it once, after the training loop"))
            elif not rep.failed(59) or crash_todo(ctx, r.failure) != 59:
                report_crash(ctx, r)
            check_imports(ctx, 41, r)  # the imports ran before the line that stopped it
            rep.note(f"(full output of the {r.name} run: {r.dir / 'output.txt'})")
            return
    check_imports(ctx, 41, run)
    stepped = run.ranks[0].get("profiler_steps", 0)
    if stepped > run.summary["steps"]:  # its trace written inside the timed intervals
        rep.waits(42, f"the tokens/s are compared once the profiler steps once per training "
                  f"step ({stepped} profiler steps in {run.summary['steps']} training steps: "
                  "TODO 43's FIX)")
    else:
        check_reports(ctx, run)
    check_peak_precision(ctx, run, fast)
    profiling = "--profile" not in run.ranks[0].get("parser", {}).get("missing", [])
    names = check_profiler(ctx, run, short, profiling)
    check_ranges(ctx, names, profiling)
    check_precision(ctx, run, fast, ref)
    check_fused_and_compile(ctx, run, fast)
    check_on_a_gpu(ctx, run, gpu, profiling)
    check_rates_between_reports(ctx, gpu)
    check_gpu_busy(ctx, run, profiling)
    check_padding(ctx, run, short)
    check_loss_compiled(ctx, run, short)
    check_ddp_for_one_process(ctx, run, fast)
    check_compile_mode(ctx, fast, run, gpu)
    check_plain_compile(ctx, short)


def profiler_after_stop(ctx, run) -> bool:
    """A run killed by a segfault at a line that steps the profiler, below a profiler.stop()
    inside the training loop (PyTorch's profiler crashes when stepped after it stopped)."""
    f = run.failure
    lines = ctx.text.splitlines()
    if not (f and f.line and "signal 11" in (f.message or "") and 0 < f.line <= len(lines)):
        return False
    return "profiler" in lines[f.line - 1] and any(
        "profiler.stop()" in l for l in lines[:f.line - 1] + lines[f.line:]
        if l.startswith("        "))  # indented into the epoch loop


def number(text: str, unit: str = "") -> float:
    value = float(text.replace(",", ""))
    return value * {"": 1, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}[unit]


def own_lines(output: str, record: dict) -> list[str]:
    """The lines the script printed itself: not the course monitor's log line (which reports
    tokens/s and MFU too, for TODO 42's numbers to be compared with)."""
    monitor = monitor_lines(record)
    return [l for l in output.splitlines() if not any(m in l for m in monitor)]


def monitor_lines(record: dict) -> list[str]:
    """The lines the course monitor printed (its first report has a second line, which says
    whose numbers the lines show)."""
    return [part.strip() for text in record.get("monitor_lines", [])
            for part in str(text).splitlines() if part.strip()]


def mfu_shown(match) -> tuple[str, float]:
    """(the MFU as printed, the factor that makes it a percentage) of an MFU match: a number
    printed without % is a fraction where it is 1 or less (MFU 0.101), else a percentage."""
    if match.group(3) is None:
        return match.group(1) or match.group(2), 1.0
    return match.group(3), 100.0 if float(match.group(3)) <= 1 else 1.0


def joined(lines: list[str]) -> list[str]:
    """The lines, where a step's tokens/s and its MFU are printed on two lines one after the
    other, the two joined into one."""
    out = []
    for line in lines:
        prev = out[-1] if out else ""
        here, before = STEP.search(line), STEP.search(prev)
        halves = [(bool(RATE.search(t)), bool(MFU.search(t))) for t in (prev, line)]
        if before and (not here or here.group(1) == before.group(1)) and (
                halves in ([(True, False), (False, True)], [(False, True), (True, False)])):
            out[-1] = f"{prev} {line}"
        else:
            out.append(line)
    return out


def step_reports(lines: list[str]) -> list[tuple[int, float, float]]:
    """(step, tokens/s, MFU in %) of every line that reports both (or two lines one after
    the other, one each)."""
    found = []
    for line in joined(lines):
        rate, mfu, step = RATE.search(line), MFU.search(line), STEP.search(line)
        if rate and mfu and step:
            shown, percent = mfu_shown(mfu)
            found.append((int(step.group(1)), number(rate.group(1), rate.group(2) or ""),
                          float(shown) * percent))
    return found


def check_reports(ctx, run) -> None:
    """TODO 42: a tokens/s and MFU report per logged step, each one right."""
    rep = ctx.report
    r0 = run.ranks[0]
    lines = own_lines(run.outputs[0], r0)
    output = "\n".join(lines)
    reports = step_reports(lines)
    peak_said = any(near(number(m.group(1), m.group(2)), PEAK_FLOPS, 0.02)
                    for m in FLOPS.finditer(output))
    called_peak = any(c["name"] == "peak_flops" and c["direct"] for c in r0.get("calls", []))
    if reports or peak_said or called_peak:
        rep.attempt(42)
    steps = run.summary["steps"]
    world = run.geometry.world
    # the FLOPs per token of the model's own parameter count (selfcheck/probe.py), not the
    # script's: the printed MFU is held against what it should be
    model = r0.get("model_flops") or {}
    flops = model.get("flops_matmuls") or run.summary["flops_per_token"]
    if not reports and re.search(r"\bnan\s*tokens?/s", output, re.I):
        rep.fail(42, "the step lines print nan tokens/s: a rate the script does not measure "
                 "itself (the course monitor's throughput.tokens_per_s() is its own, and "
                 "reading it ends its interval); time each interval: synchronize(device), then "
                 "rate = interval_tokens / (time.perf_counter() - interval_start)")
        return
    if not reports:
        rep.fail(42, "no step line reports tokens/s and MFU: measure each interval "
                 "(synchronize(device), then rate = interval_tokens / elapsed) and print "
                 "'... <rate> tokens/s MFU <x>%' with the loss")
        return
    printed = [number(m.group(1), m.group(2)) for m in FLOPS.finditer(output)]
    off = next((f for f in (1e3, 1e-3, 1e6, 1e-6) if any(near(p, PEAK_FLOPS * f, 0.02)
                                                          for p in printed)), None)
    if not peak_said and off:
        rep.fail(42, f"the peak printed is {off:g} x what peak_flops returns: a unit's power of "
                 "ten is off (TFLOP/s is peak / 1e12)")
    elif not peak_said:
        shown = [m.group(0) for m in FLOPS.finditer(output)]
        # the one said next to "peak" or "MFU", if any (FLOPs per token may be printed too)
        shown = [t for t in shown if re.search(rf"(peak|MFU)[^\n]*{re.escape(t)}|"
                                               rf"{re.escape(t)}[^\n]*(peak|MFU)", output,
                                               re.I)] or shown
        if shown:
            rep.fail(42, f"the printed peak ({shown[0]}) does not show {PEAK_FLOPS:.3g} FLOP/s, "
                     "what peak_flops returns in this check: print it with 3 significant "
                     "digits (e.g. {peak:.3g} FLOP/s, or {peak / 1e12:.3g} TFLOP/s)")
        else:
            rep.fail(42, "nothing printed says what MFU divides by (no number in FLOP/s): "
                     "print the peak of one device that peak_flops(device, args.precision) "
                     "returns, and where it comes from")
    if len({s for s, _, _ in reports}) < steps:
        rep.fail(42, f"{len(reports)} step lines report tokens/s and MFU, the run logged "
                 f"{steps} steps (--log-every 1): report at every log step")
        return
    theirs = monitor_rates(r0)
    ratios = [t / theirs[s] for s, t, _ in reports if theirs.get(s)]
    bad = [(s, t, m) for s, t, m in reports if not (t > 0 and 0 < m <= 100)]
    if bad and ratios and not 0.75 <= statistics.median(ratios) <= 1.33:
        # an MFU that rounds to 0 %: the rate is what is wrong
        median = statistics.median(ratios)
        rep.fail(42, f"the tokens/s printed are {median:.2g} x the course monitor's for the "
                 f"same steps: {rate_hint(median, ratios, world)}")
        return
    if bad:
        s, t, m = bad[0]
        times = m / (100 * t * flops / (PEAK_FLOPS * world)) if t > 0 else 0
        power = round(math.log10(times)) if times > 0 else 0
        rep.fail(42, f"step {s} reports {t:g} tokens/s and MFU {m:g}%: " + (
            "100 x the formula's, as the format :.1% multiplies by 100 itself: print the "
            "fraction, MFU {rate * flops_per_tok / (peak * world_size):.1%}" if power == 2
            and near(times, 100, 0.05) else
            f"1e{power} x the formula's: MFU divides by the peak in FLOP/s, as peak_flops "
            "returns it (a TFLOP/s figure, peak / 1e12, is for printing only): "
            "rate * flops_per_tok / (peak * world_size)" if power >= 3
            and near(times, 10.0 ** power, 0.05) else
            "MFU is rate * flops_per_tok / (peak * world_size), between 0 and 100 %"))
        return
    # tokens/s first: a rate of one rank with MFU over one device's peak gives the right MFU,
    # and fixing the MFU alone would make it wrong. The course monitor's line of the same step
    # measures the same interval (utils/monitor.py): the script's rate should agree with it.
    monitor = monitor_lines(r0)
    agree = [(s, t / theirs[s]) for s, t, _ in reports if theirs.get(s)]
    off = [(s, q) for s, q in agree if not 0.75 <= q <= 1.33]
    # at two steps or more: a wrong count or interval is off at many steps, a moment of a busy
    # machine at one (a right file's first timed step read 1.5 x in CI)
    if len(agree) >= 3 and len(off) >= 2:
        qs = [q for _, q in agree]
        step, q = off[0]
        how = rate_hint(statistics.median(qs), qs, world)
        rep.fail(42, f"step {step} prints {q:.2g} x the tokens/s of the course monitor's line "
                 f"for the same step: {how}")
        return
    prints = [p for p in r0.get("prints", []) if STEP.search(p["text"]) and RATE.search(p["text"])
              and not any(m and m in p["text"] for m in monitor)]
    tokens_per_step = BATCH * world * SEQ_LEN
    per_epoch = steps // 2
    seen = []
    for a, b in zip(prints, prints[1:], strict=False):
        sa, sb = int(STEP.search(a["text"]).group(1)), int(STEP.search(b["text"]).group(1))
        if sb <= sa or (sa - 1) // per_epoch != (sb - 1) // per_epoch:
            continue  # across an evaluation: not training time
        rate = number(*RATE.search(b["text"]).groups(default=""))
        seen.append(rate * (b["t"] - a["t"]) / ((sb - sa) * tokens_per_step))
    # the last rate of an epoch against the clock from its first report to its last: a rate
    # of one rank stays 1/world_size there, a rate never reset (an average since the epoch
    # began) comes near the truth
    spans = []
    for epoch in sorted({(int(STEP.search(p["text"]).group(1)) - 1) // per_epoch for p in prints}):
        mine = [p for p in prints if (int(STEP.search(p["text"]).group(1)) - 1) // per_epoch
                == epoch]
        if len(mine) >= 3 and mine[-1]["t"] > mine[0]["t"]:
            first, last = (int(STEP.search(p["text"]).group(1)) for p in (mine[0], mine[-1]))
            rate = number(*RATE.search(mine[-1]["text"]).groups(default=""))
            spans.append(rate * (mine[-1]["t"] - mine[0]["t"]) / ((last - first)
                                                                  * tokens_per_step))
    if len(seen) >= 3:
        factor = statistics.median(seen)
        span = statistics.median(spans) if spans else factor
        if not 0.6 <= factor <= 1.6:
            how = ("count the tokens of all ranks, interval_tokens += x.numel() * world_size"
                   if abs(factor * world - 1) < 0.25 and abs(span * world - 1) < 0.25 else
                   "the rate of each interval between two reports: after each report, "
                   "interval_tokens, interval_start = 0, time.perf_counter()")
            rep.fail(42, f"the tokens/s printed are {factor:.2g} x the tokens trained per second "
                     f"({tokens_per_step} tokens per step on {world} ranks): {how}")
            return
    # the first report after an evaluation: its interval must start after the evaluation
    # (the clock restarted with the epoch), not at the report before it. The evaluations'
    # start and end as the probe saw them (each made EVAL_PAUSE longer), else the line that
    # prints the validation loss as the end of one of unknown length
    windows = r0.get("eval_windows") or [
        (p["t"], p["t"]) for p in r0.get("prints", []) if "validation" in p["text"].lower()]
    for start, end in windows:
        before = [p for p in prints if p["t"] < start]
        after = [p for p in prints if p["t"] > end]
        if not before or not after:
            continue
        a, b = before[-1], after[0]
        sa, sb = int(STEP.search(a["text"]).group(1)), int(STEP.search(b["text"]).group(1))
        rate = number(*RATE.search(b["text"]).groups(default=""))
        if rate <= 0 or sb <= sa:
            continue
        interval = (sb - sa) * tokens_per_step / rate
        if interval > (b["t"] - end) + 0.5 * (end - a["t"]):
            rep.fail(42, f"the tokens/s of step {sb}, the first after an evaluation, count the "
                     "evaluation's time too: start the interval with each epoch, "
                     "interval_tokens, interval_start = 0, time.perf_counter() before its loop")
            return
    counted = embeddings_counted(r0, run.summary, lines, world)
    if counted:
        rep.fail(42, counted)
        return
    ratios = [m / 100 / (t * flops / (PEAK_FLOPS * world)) for _, t, m in reports if t > 0]
    ratio = statistics.median(ratios)
    if not near(ratio, 1.0, 0.05, 0.0) and not all(
            abs(m / 100 - t * flops / (PEAK_FLOPS * world)) < 0.0006 for _, t, m in reports):
        how = (f"MFU comes out {ratio:.2g} x the formula's" +
               (f": divide by the peak of all {world} devices, peak * world_size" if near(
                   ratio, world, 0.05) else ""))
        rep.fail(42, f"{how} (MFU = tokens/s x {flops:.3g} FLOPs per token / ({PEAK_FLOPS:.3g} "
                 f"FLOP/s x {world} devices))")
        return
    # (synchronize: judged on the stand-in GPU, where the script's cuda branches run: see
    # check_on_a_gpu)
    if not rep.failed(42):
        rep.ok(42, f"{len(reports)} step lines report tokens/s and MFU per device, both right, "
               "against the peak it prints")


def embeddings_counted(record: dict, summary: dict, lines: list[str], world: int) -> str | None:
    """TODO 42: what is wrong with the parameters MFU's FLOPs per token count, or None.

    The check's corpus has a vocabulary of 42 words: there the embedding tables change the
    FLOPs by 3 %, less than a printed MFU may be off, while on WikiText-2 (33,278 words) they
    add 30 % to the workshop model's. So the counts tell: the parameters the script gave
    flops_per_token, the FLOPs per token it gave training_summary, and, where it computed them
    by other means for its own line, printed MFUs that each fit all parameters to their last
    digit and the matmuls' alone not."""
    model = record.get("model_flops")
    if not model:
        return None
    matmuls, every = model["matmuls"], model["all"]
    given = [c["n_params"] for c in record.get("calls", [])
             if c["name"] == "flops_per_token" and c["direct"] and c.get("n_params") is not None]
    # more than the matmuls' weights: a table counted; fewer by the output projection or more
    # (its weights left out too; a count of the weight matrices alone, without the norms and
    # biases, is a fair 6 N)
    output = model.get("output") or 0
    wrong = next((n for n in given if n > matmuls or (output and n <= matmuls - output)), None)
    fix = ("tok_emb and pos_emb are lookups, not matmuls, and cost no FLOPs: exclude them, "
           "flops_per_token(model.num_params(exclude_embeddings=True), ...); the output "
           "projection is a matmul and stays counted")
    if wrong is not None and wrong < matmuls:
        return (f"MFU's FLOPs per token count {wrong:,} parameters, {matmuls - wrong:,} fewer "
                f"than the model's matmuls hold ({matmuls:,}): the output projection is a "
                "matmul and stays counted; "
                "leave out only the embedding tables (lookups), "
                "flops_per_token(model.num_params(exclude_embeddings=True), ...)")
    if wrong is not None:
        return (f"MFU's FLOPs per token count {wrong:,} parameters, {wrong - matmuls:,} of them "
                f"in the embedding tables (on WikiText-2 they make MFU about 30 % too high): "
                f"{fix}")
    # (6 N of all parameters, without the attention's 12 L d T, comes out within 1 % of the
    # right count on the check's model: its FLOPs per token tell)
    given_flops = summary.get("flops_per_token") or 0
    if given_flops and near(given_flops, 6 * matmuls, 1e-9) and \
            not near(model["flops_matmuls"], 6 * matmuls, 1e-9):
        return (f"MFU's FLOPs per token are 6 N alone ({given_flops:,.0f}): the attention's "
                f"scores and weighted sums add 12 L d T ({model['flops_matmuls'] - given_flops:,.0f}"
                "), which no weight counts: flops_per_token(model.num_params("
                "exclude_embeddings=True), cfg.n_layers, cfg.d_model, cfg.max_seq_len)")
    if near(given_flops, model["flops_all"], 1e-9) or near(given_flops, 6 * every, 1e-9) or (
            not mfus_fit(lines, model["flops_matmuls"], world)
            and mfus_fit(lines, model["flops_all"], world)):
        return (f"MFU's FLOPs per token count all {every:,} parameters, the embedding tables' "
                f"{every - matmuls:,} too (on WikiText-2 they make MFU about 30 % too high): "
                f"{fix}")
    return None


def half_digit(text: str) -> float:
    """Half a unit of the last digit printed: '6.5' -> 0.05, '5095' -> 0.5, '1.2e+03' -> 50."""
    mantissa, _, exponent = text.replace(",", "").lower().partition("e")
    return 0.5 * 10.0 ** (int(exponent or 0) - len(mantissa.partition(".")[2]))


def mfus_fit(lines: list[str], flops: float, world: int) -> bool:
    """Whether the MFU of every step line is its tokens/s x `flops` / (peak x world), up to the
    rounding of the two numbers as printed."""
    fit = False
    for line in joined(lines):
        rate, mfu, step = RATE.search(line), MFU.search(line), STEP.search(line)
        if not (rate and mfu and step):
            continue
        unit = number("1", rate.group(2) or "")
        tokens, tokens_off = number(rate.group(1), rate.group(2) or ""), half_digit(
            rate.group(1)) * unit
        shown, percent = mfu_shown(mfu)
        per_token = 100 * flops / (PEAK_FLOPS * world)  # MFU in % per token/s
        if abs(float(shown) * percent - tokens * per_token) > (
                half_digit(shown) * percent + tokens_off * per_token) * (1 + 1e-9):
            return False
        fit = True
    return fit


def rate_hint(median: float, ratios: list, world: int) -> str:
    """What to change where the printed tokens/s are `median` x the course monitor's."""
    if all(abs(q * world - 1) < 0.15 for q in ratios):
        return "count the tokens of all ranks, interval_tokens += x.numel() * world_size"
    if near(median, 1 / SEQ_LEN, 0.15) or near(median, 1 / (SEQ_LEN * world), 0.15):
        return ("count tokens, not sequences: interval_tokens += x.numel() * world_size (len(x) "
                "is the batch's rows)")
    if near(median, 1e-3, 0.3) or near(median, 1e3, 0.3):
        return ("time.perf_counter() counts seconds: rate = interval_tokens / elapsed seconds "
                "(no factor of 1000)")
    rising = sum(b > a * 1.2 for a, b in zip(ratios, ratios[1:])) / max(len(ratios) - 1, 1)
    if median > 1 and len(ratios) >= 3 and max(ratios) > 1.8 * min(ratios) and rising >= 0.6:
        return ("the rate grows from report to report: the tokens add up while the clock "
                "starts again; after each report set both back, interval_tokens, "
                "interval_start = 0, time.perf_counter()")
    if median > 1:
        return ("the time counted is shorter than the interval: start the clock only after "
                "each report and at each epoch's start (interval_start = time.perf_counter()), "
                "not inside the step")
    return ("the rate of the interval since the last report: after each report, "
            "interval_tokens, interval_start = 0, time.perf_counter()")


def monitor_rates(record) -> dict[int, float]:
    """step -> the tokens/s of the course monitor's line for it (utils/monitor.py), which
    measures the same interval as the script's own report."""
    return {int(STEP.search(l).group(1)): number(*RATE.search(l).groups(default=""))
            for l in record.get("monitor_lines", []) if STEP.search(l) and RATE.search(l)}


def check_rates_between_reports(ctx, gpu) -> None:
    """TODO 42 where reports are two steps apart (the stand-in GPU run, --log-every 2): the
    rate counts the tokens of every step since the last report, not only the last step's, and
    over the time of every step since then: a clock restarted inside each step reads about 2 x
    here, where at --log-every 1 it differs from the truth by a data wait only (a tiny model's
    milliseconds, within a loaded machine's jitter)."""
    rep = ctx.report
    if rep.failed(42) or 42 in rep.waiting or gpu.crashed or not gpu.ranks or not gpu.ranks[0]:
        return
    theirs = monitor_rates(gpu.ranks[0])
    reports = step_reports(own_lines(gpu.outputs[0], gpu.ranks[0]))
    # (the first report of the run is left out: its interval holds the warm-up)
    ratios = [rate / theirs[s] for s, rate, _ in reports[1:] if theirs.get(s)]
    if len(ratios) < 2:
        return
    median = statistics.median(ratios)
    short = first_report_overcounted(gpu)
    if short and 0.7 <= median <= 1.5:
        step, q = short
        rep.fail(42, f"with --log-every 2, step {step}, the epoch's first report after fewer "
                 f"steps, prints {q:.2g} x the tokens its batches trained per second: "
                 "count the tokens of the steps trained since the last report, "
                 "interval_tokens += x.numel() * world_size at every step, not --log-every "
                 "times a step's")
    elif median > 1.5:
        rep.fail(42, f"with --log-every 2 the tokens/s printed are {median:.2g} x the course "
                 f"monitor's for the same steps: {rate_hint(median, ratios, len(gpu.ranks))}")
    elif median < 0.7:
        rep.fail(42, f"with --log-every 2 the tokens/s printed are {median:.2g} x the course "
                 "monitor's for the same steps: count every step's tokens since the last report,"
                 " interval_tokens += x.numel() * world_size after each step, and divide that "
                 "sum by the time")


def first_report_overcounted(gpu) -> tuple[int, float] | None:
    """(step, how many times too many) of an epoch's first report whose rate counts more
    tokens than the epoch trained so far: the epoch's steps since its batches began, fewer
    than --log-every where the epoch's length does not divide by it. Timed from the moment
    the epoch's first batch was asked for (the probe's clock), not by the monitor's line,
    whose interval may hold a save after the evaluation or the profiler writing its trace."""
    record = gpu.ranks[0]
    n_train = ((record.get("datasets") or [{}])[0]).get("len")
    world = len(gpu.ranks)
    per_epoch = n_train // (BATCH * world) if n_train else 0
    monitor = monitor_lines(record)
    reports = [p for p in record.get("prints", []) if STEP.search(p["text"])
               and RATE.search(p["text"]) and not any(m and m in p["text"] for m in monitor)]
    for start in record.get("train_passes_t", [])[1:]:  # (the first epoch's holds warm-up)
        b = next((p for p in reports if p["t"] > start), None)
        if b is None or not per_epoch:
            continue
        step = int(STEP.search(b["text"]).group(1))
        trained = (step - 1) % per_epoch + 1
        rate = number(*RATE.search(b["text"]).groups(default=""))
        q = rate * (b["t"] - start) / (trained * BATCH * world * SEQ_LEN)
        if q > 1.6:
            return step, q
    return None


def trace_events(path):
    try:
        return json.loads(path.read_text()).get("traceEvents", [])
    except (OSError, ValueError):
        return []


def check_peak_precision(ctx, run, fast) -> None:
    """TODO 42: MFU divides by the peak of the precision the run computes in (a GPU's bf16
    peak is 15 times its fp32 one; on the check's CPU both are PEAK_FLOPS, so the argument
    tells)."""
    rep = ctx.report
    if rep.failed(42):
        return
    for r in (run, fast):
        computes = r.summary.get("precision")
        asked = {c.get("precision") for c in r.ranks[0].get("calls", [])
                 if c["name"] == "peak_flops" and c["direct"]}
        if computes and asked and asked != {computes}:
            rep.fail(42, f"the --precision {computes} run asks peak_flops for "
                     f"{' and '.join(sorted(map(str, asked)))}: MFU must divide by the peak of "
                     "what the run computes in, peak_flops(device, args.precision) after "
                     "args.precision = set_precision(...)")
            return


def check_profiler(ctx, run, short, profiling) -> set:
    """TODO 43: a trace per rank of the window's steps, the operator table, short runs.
    Returns the names of the user ranges in rank 0's trace."""
    rep = ctx.report
    if not profiling:
        rep.fail(43, "there is no --profile option yet (see TODO 43)")
        return set()
    rep.attempt(43)
    traces = [sorted((run.out / "profile").glob(f"rank{r}.*.pt.trace.json"))
              for r in range(run.geometry.world)]
    written = sorted((run.out / "profile").glob("*.pt.trace.json")) if (
        run.out / "profile").is_dir() else []
    if written and not any(traces):
        rep.fail(43, f"the traces are named {written[0].name.split('.')[0]}.*: name each "
                 "rank's file after its rank, tensorboard_trace_handler(..., "
                 "worker_name=f'rank{rank}')")
        return user_ranges(trace_events(written[0]))
    elsewhere = sorted(run.out.rglob("*.pt.trace.json")) if not written else []
    if elsewhere:
        folder = elsewhere[0].parent.relative_to(run.out)
        rep.fail(43, f"the traces are in OUT_DIR/{folder}".rstrip("/.") + ", not "
                 "OUT_DIR/profile, where the course's tools look: tensorboard_trace_handler("
                 "str(out_dir / 'profile'), worker_name=f'rank{rank}')")
        return user_ranges(trace_events(elsewhere[0]))
    if not written:
        rep.fail(43, "--profile wrote no trace into OUT_DIR/profile: profiler = "
                 "make_profiler(out_dir, rank, device, steps_available), profiler.step() after "
                 "each step, profiler.stop() at the end")
        rep.waits(44, "the named ranges are checked in the trace, once --profile writes one")
        return set()
    missing = [r for r, t in enumerate(traces) if not t]
    if missing:
        rep.fail(43, f"--profile wrote no trace for rank(s) {missing}: every rank profiles "
                 "(worker_name=f'rank{rank}')")
        return set()
    events = trace_events(traces[0][-1])
    names = user_ranges(events)
    steps = sorted(int(n.split("#")[1]) for n in {e.get("name", "") for e in events}
                   if n.startswith("ProfilerStep#"))
    tables = run.ranks[0].get("tables", [])
    printed = any(t["first_line"] and t["first_line"] in run.outputs[0] for t in tables)
    # the window the script's own constants describe (the shipped 1, 2, 3: steps 3 to 5)
    wait, warmup, active = run.ranks[0].get("profile_window") or (1, 2, 3)
    window = list(range(wait + warmup, wait + warmup + active))
    windows = run.ranks[0].get("profiler_windows")
    misfit = window_misfit(windows)
    if len(traces[0]) > 1:
        rep.fail(43, f"rank 0 wrote {len(traces[0])} traces: the schedule starts its window "
                 "again after each one; schedule(wait=..., warmup=..., active=..., repeat=1) "
                 "records it once")
    elif misfit:
        rep.fail(43, misfit)
    elif steps != window:
        rep.fail(43, f"the trace holds steps {steps or 'none'}, the window is {window[0]} to "
                 f"{window[-1]} (skip {wait}, warm up {warmup}, record {active}): call "
                 "profiler.step() once after every training step")
    elif not printed:
        rep.fail(43, "after profiler.stop(), print0 the operator table: "
                 "profiler.key_averages().table(sort_by=..., row_limit=12)")
    elif any(t.get("sort_by") == "cpu_time_total" for t in tables):
        rep.fail(43, "on a CPU the operator table is sorted by cpu_time_total, which counts "
                 "every operator's children too (the operators that call others rise to the "
                 "top with time they did not spend themselves): sort by the time each operator "
                 "itself took, sort_by='self_cpu_time_total'")
    else:
        rep.ok(43, f"each rank writes a trace of steps {window[0]}-{window[-1]}, and the "
               "operator table is printed" + ("; profiler_window fits runs of 1 to 12 steps "
                                              "and keeps its window in long ones" if windows
                                              else ""))
    if short.crashed and (vocab_of(short) or 0) < (vocab_of(run) or 0):
        return names  # a vocabulary padded down to nothing: TODO 60 says so
    if short.crashed:
        f = short.failure
        if f and crash_todo(ctx, f) == 59:  # gpu_busy asked of the profiler the run did not make
            rep.fail(59, f"with --profile --max-steps 1 the run stops{f.where()} with: "
                     f"{f.message}: a run too short to profile has no profiler, so call "
                     "gpu_busy only if profiler is not None")
            return names
        rep.fail(43, f"with --profile --max-steps 1 the run stops{f.where() if f else ''} with: "
                 f"{f.message if f else '?'}: a run too short to profile must say so and train "
                 "(profiler_window returns None)")
        return names
    written = list((short.out / "profile").glob("*.pt.trace.json")) if (
        short.out / "profile").is_dir() else []
    started = short.ranks[0].get("profilers_started", 0)
    said = any("profil" in p["text"].lower() for p in short.ranks[0].get("prints", []))
    recorded = [n for f in written for e in trace_events(f)
                for n in [e.get("name", "")] if n.startswith("ProfilerStep#")]
    given = [c["args"][3] if len(c["args"]) > 3 else c["kwargs"].get("steps_available")
             for c in short.ranks[0].get("own_calls", {}).get("make_profiler", [])]
    if started and not recorded and given and isinstance(given[0], int) and given[0] > 1:
        rep.fail(43, f"with --profile --max-steps 1, make_profiler gets steps_available="
                 f"{given[0]}, the steps of every epoch: the run stops after one, so "
                 "steps_available = min(steps_available, args.max_steps) when --max-steps is "
                 "given")
    elif started and not recorded:
        rep.fail(43, "with --profile --max-steps 1 a profiler starts, but its window cannot fit "
                 "into one step and no trace is written: profiler_window returns None for such "
                 "a run, and make_profiler says it is too short to profile")
    elif not written and not said:
        rep.fail(43, "with --profile and one step nothing is profiled and nothing says so: "
                 "print that the run is too short to profile")
    return names


def as_window(called: dict | None):
    """What profiler_window returned (selfcheck/probe.py, lesson_call): (wait, warmup, active)
    as ints, None, or "other" (an error, or not three whole numbers: not judged)."""
    value = (called or {}).get("value", "other")
    if value == "None":
        return None
    if isinstance(value, list) and len(value) == 3 and all(
            isinstance(v, float) and v == int(v) for v in value):
        return tuple(int(v) for v in value)
    return "other"


def window_misfit(windows: dict | None) -> str | None:
    """TODO 43: what is wrong with the windows profiler_window gives runs of 1 to 12 steps and
    long ones (called in-process: the check's runs take 1 and 10 steps), or None. A window
    must fit into the steps (wait + warmup + active <= steps, active >= 1: torch's schedule
    refuses 0), or be None (too short to profile), and stay the same however long the run."""
    if not windows or all("error" in v for v in windows.values()):
        return None  # not there, or called otherwise than profiler_window(steps_available)
    for n in range(1, 13):
        called = windows.get(str(n), {})
        if "error" in called:
            return (f"profiler_window({n}) stops with {called['error']}: a run of {n} steps "
                    f"(--max-steps {n}) would stop there; return a window that fits, or None "
                    "when the run is too short to profile")
        window = as_window(called)
        if window is None:
            continue
        if window == "other":
            return None
        wait, warmup, active = window
        if min(wait, warmup) < 0 or active < 1:
            return (f"profiler_window({n}) returns {window}: torch's schedule needs wait and "
                    "warmup of 0 or more and at least 1 active step; for a run too short for "
                    "any, return None")
        if wait + warmup + active > n:
            return (f"profiler_window({n}) returns {window}, a window of "
                    f"{wait + warmup + active} steps: a run of {n} steps (--max-steps {n}) ends "
                    "before it, and its trace holds a partial step or nothing. Shrink it to "
                    "the steps available, e.g. (0, 1, steps_available - 1) when steps_available "
                    "< PROFILE_WAIT + PROFILE_WARMUP + PROFILE_ACTIVE, or return None (too short "
                    "to profile)")
    long, longer = (as_window(windows.get(str(n))) for n in (1000, 100_000))
    if long is None:
        return ("profiler_window(1000) returns None: a long run is never profiled; return "
                "(PROFILE_WAIT, PROFILE_WARMUP, PROFILE_ACTIVE) where they fit")
    if "other" not in (long, longer) and long != longer:
        return (f"profiler_window(1000) returns {long}, profiler_window(100000) {longer}: the "
                "window grows with the run, and a long run's trace would hold all its steps "
                "(megabytes each): keep it bounded, active = min(PROFILE_ACTIVE, "
                "steps_available - wait - warmup)")
    return None


# the ranges torch adds by itself: ProfilerStep#3, enumerate(DataLoader)#..., DDP's and the
# optimizer's methods, the collectives of gloo and NCCL, compiled regions
TORCH_RANGES = re.compile(r"ProfilerStep#\d+$|enumerate\(DataLoader\)#|Optimizer\.\w+#|"
                          r"DistributedDataParallel\.|(gloo|nccl|c10d|aten|autograd|cuda)\W|"
                          r"record_param_comms|Torch-Compiled|TorchDynamo|CompiledFunction|## ")


def user_ranges(events) -> set:
    """The names of the script's own ranges in a trace (record_function's)."""
    return {n for e in events if e.get("cat") == "user_annotation"
            for n in [e.get("name", "")] if n and not TORCH_RANGES.match(n)}


def check_ranges(ctx, names: set, profiling: bool) -> None:
    rep = ctx.report
    if not names:
        if profiling and not rep.failed(43):
            rep.fail(44, "the trace has no named range: with annotate(name, device): around the "
                     "forward pass and loss, backward, the optimizer step and the all-reduce of "
                     "the loss")
        return
    rep.attempt(44)
    lower = [n.lower() for n in names]
    missing = [phase for phase, words in PHASES.items()
               if not any(any(w in n for w in words) for n in lower)]
    if missing:
        rep.fail(44, f"the trace has ranges {sorted(names)}, none for {', '.join(missing)}: "
                 "with annotate(name, device): around each phase")
    else:
        found = [n for n in sorted(names) if any(any(w in n.lower() for w in words)
                                                 for words in PHASES.values())]
        rep.ok(44, f"the trace names the phases ({', '.join(found[:6])})")


def check_precision(ctx, run, fast, ref) -> None:
    rep = ctx.report
    if vocab_of(run) != vocab_of(ref):  # another model (padded without --pad-vocab)
        rep.waits(45, "fp32 and bf16 are compared with one process once --pad-vocab 1 leaves "
                  "the data's vocabulary as it is (TODO 60)")
        return
    # two ranks without DDP train apart, whatever the precision: TODO 62 says so
    averaged = bool(run.ranks[0].get("ddp"))
    if averaged and not lists_close(run.summary["loss_history"], ref.summary["loss_history"],
                                    rel=1e-5):
        rep.fail(45, "with --precision fp32 the losses differ from the reference run: compute in "
                 "bf16 only under autocast(args.precision, device), which does nothing in fp32")
        return
    s, r = fast.summary, fast.ranks[0]
    if s.get("precision") == "bf16":
        rep.attempt(45)
    mine, theirs = s["loss_history"], ref.summary["loss_history"][:len(s["loss_history"])]
    dtypes, autocast = set(r.get("param_dtypes", [])), r.get("autocast_forward", [])
    if s.get("precision") != "bf16":
        rep.fail(45, f"--precision bf16 ran in {s.get('precision')}: "
                 "args.precision = set_precision(args.precision, device)")
    elif dtypes - {"float32"}:
        rep.fail(45, f"the weights are {', '.join(sorted(dtypes))}: keep them float32 (the "
                 "optimizer needs the precision) and run the forward pass under "
                 "autocast(args.precision, device), not model.to(torch.bfloat16)")
    elif "float16" in r.get("forward_dtypes", []) and "bfloat16" not in r.get(
            "forward_dtypes", []):
        rep.fail(45, "the bf16 run computes in float16: autocast(args.precision, device) "
                 "gives bfloat16 (float16's small range needs a GradScaler, bf16 none)")
    elif not any(autocast) or "bfloat16" not in r.get("forward_dtypes", []):
        rep.fail(45, "the bf16 run computes in fp32: run the forward pass and the loss under "
                 "autocast(args.precision, device)")
    elif r.get("autocast_no_grad"):
        rep.fail(45, "the evaluation runs under autocast too: evaluate in fp32, outside "
                 "autocast (the validation loss then compares across --precision settings, "
                 "and is not timed); autocast around the training's forward pass and loss only")
    elif len(mine) != len(theirs) or max(abs(a - b) for a, b in zip(mine, theirs, strict=True)) > 0.02:
        rep.fail(45, "the bf16 losses stray more than 0.02 from fp32's: autocast around the "
                 "forward pass and the loss only, the backward and optimizer outside it")
    else:
        gap = max(abs(a - b) for a, b in zip(mine, theirs, strict=True))
        rep.ok(45, f"bf16 runs under autocast with fp32 weights and trains like fp32 (losses "
               f"within {gap:.4f})")


def check_fused_and_compile(ctx, run, fast) -> None:
    rep = ctx.report
    adamw = fast.ranks[0].get("adamw", [])
    if any("fused" in kwargs for kwargs in adamw):
        rep.attempt(46)
        rep.ok(46, "AdamW is asked for fused")
    else:
        rep.fail(46, "torch.optim.AdamW(..., fused=device.type == 'cuda'): one kernel for all "
                 "parameters on a GPU")
    compiled, unasked = fast.ranks[0].get("compiled", []), run.ranks[0].get("compiled", [])
    if compiled or unasked:
        rep.attempt(47)
    out_of_place = [c["what"] for c in fast.ranks[0].get("compile_calls", [])
                    if c["module"] and not c.get("in_place", True)]
    # what --compile compiles before TODO 63 compiles again in the mode asked for
    plain = {c["what"] for c in fast.ranks[0].get("compile_calls", [])
             if c["module"] and c["mode"] in (None, "default")}
    if unasked:
        rep.fail(47, f"{', '.join(unasked)} compiled without --compile: only `if args.compile:`")
    elif out_of_place and set(out_of_place) == {"Block"} and "OptimizedModule" not in \
            fast.ranks[0].get("block_types", ["OptimizedModule"]):
        rep.fail(47, "torch.compile(block) returns a new, compiled module, and the model keeps "
                 "its plain blocks (a loop's name for each is all that changes): compile them "
                 "in place, if args.compile: compile_blocks(model) (block.compile() for each)")
    elif out_of_place:
        rep.fail(47, f"model = torch.compile(model) wraps the {out_of_place[0]} in a new module "
                 "whose weights are all renamed _orig_mod.*, in every checkpoint: compile the "
                 "blocks in place, if args.compile: compile_blocks(model), before any DDP wrap")
    elif "DistributedDataParallel" in compiled:
        rep.fail(47, "--compile compiles the DDP wrapper: compile the blocks before wrapping, "
                 "if args.compile: compile_blocks(model), then DDP(model, ...)")
    elif "TransformerLM" in plain and "Block" not in plain:
        rep.fail(47, "--compile compiles the whole model in one: TODO 47 compiles each block, "
                 "if args.compile: compile_blocks(model), the form that FSDP, tensor and "
                 "pipeline parallelism keep, and that TODO 63 compiles again in a mode")
        rep.waits(63, "the modes are checked once --compile compiles the blocks (TODO 47's FIX)")
        ctx.extra["whole_model_compiled"] = True
    elif "Block" in compiled or "TransformerLM" in compiled:
        rep.ok(47, "--compile compiles the Transformer blocks (recorded, not run, here)")
    else:
        rep.fail(47, "--compile compiled nothing: if args.compile: compile_blocks(model), "
                 "before the model is wrapped in DDP")



def check_gpu_busy(ctx, run, profiling) -> None:
    """TODO 59: gpu_busy on a stand-in GPU profile (kernels 6 ms of each 10 ms step) and a CPU
    one, and its line printed after the profile."""
    rep = ctx.report
    r0 = run.ranks[0]
    busy = r0.get("gpu_busy")
    if busy is None:
        return  # not started: no gpu_busy yet
    rep.attempt(59)
    gpu, cpu = busy["gpu"], busy["cpu"]
    if "error" in gpu:
        rep.fail(59, f"gpu_busy(profiler) stops with {gpu['error']}: it takes the stopped "
                 "profiler and returns (kernel ms per step, step ms) from "
                 "profiler.key_averages()")
        return
    value = gpu["value"]
    if not (isinstance(value, list) and len(value) == 2
            and all(isinstance(v, float) for v in value)):
        rep.fail(59, f"gpu_busy returned {value!r} for a GPU profile: return two numbers, "
                 "(kernel ms per step, step ms)")
        return
    kernels, step = value
    if near(step, 6.0, 0.01) and near(kernels, 10.0, 0.01):
        rep.fail(59, "gpu_busy returns (10, 6) for kernels of 6 ms in steps of 10 ms: the two "
                 "are swapped, return (kernel ms per step, step ms)")
    elif any(near(v, 1e3 * w, 0.01) for v, w in ((step, 10.0), (kernels, 6.0))):
        rep.fail(59, f"gpu_busy returns {kernels:g} and {step:g} for kernels of 6 ms in steps "
                 "of 10 ms: the profiler counts microseconds, divide by 1e3 for ms")
    elif near(step, 5.0, 0.01):
        rep.fail(59, "a profile of four 10 ms steps gives 5 ms per step: the steps were counted "
                 "twice. On a GPU key_averages() has a second 'ProfilerStep*' row, the steps on "
                 "the GPU's timeline (device_type CUDA, no CPU time): take the CPU's row only "
                 "(e.device_type == DeviceType.CPU)")
    elif not near(step, 10.0, 0.01):
        rep.fail(59, f"a profile of four 10 ms steps gives {step:g} ms per step: the CPU time "
                 "of the 'ProfilerStep*' row of key_averages() (cpu_time_total: its "
                 "self_cpu_time_total leaves out the operators the step ran), divided by the "
                 "steps it counts (its count)")
    elif not near(kernels, 6.0, 0.01):
        # the sums of the stand-in's rows (selfcheck/probe.py, _StandInProfiler)
        what = ("each kernel was counted twice: its own row on the GPU and again the row of "
                "the CPU operator that launched it" if near(kernels, 12.0, 0.01) else
                "each kernel was counted twice (its own row on the GPU and again the row of "
                "the CPU operator that launched it), and the ranges' rows on the GPU "
                "(ProfilerStep, record_function) added" if near(kernels, 25.5, 0.01) else
                "the ranges' rows on the GPU (ProfilerStep, record_function: "
                "is_user_annotation) were added to the kernels" if near(kernels, 19.5, 0.01)
                else "device_time_total counts the kernels of the operators inside an operator "
                "again" if near(kernels, 42.3, 0.01) else "")
        rep.fail(59, f"kernels of 6 ms per step give {kernels:g} ms"
                 + (f": {what}" if what else "") + ". Sum self_device_time_total over the rows "
                 "that ran on the GPU and are no range (e.device_type != DeviceType.CPU and "
                 "not e.is_user_annotation): the kernels, once; divided by the steps")
    elif not (isinstance(cpu.get("value"), list) and cpu["value"][:1] == [0.0]):
        rep.fail(59, f"a CPU profile (no kernels) gives {cpu.get('value', cpu.get('error'))}: "
                 "its kernel time is 0 (then say there is no GPU to compare with)")
    elif profiling and not any(re.search(r"busy|kernel|idle|wait", p["text"], re.I)
                               for p in r0.get("prints", [])):
        rep.fail(59, "nothing printed after the profile says how busy the GPU was: print0 the "
                 "two numbers (on a CPU: that there is no GPU to compare with)")
    else:
        rep.ok(59, "gpu_busy reads 6 of 10 ms on a GPU profile and nothing on a CPU's, and "
               "the run says so")


def vocab_of(run) -> int | None:
    """The model's vocabulary: from the summary, or as the model was built (a crashed run)."""
    if run.summary:
        return run.summary.get("model_config", {}).get("vocab_size")
    return run.ranks[0].get("model_vocab") if run.ranks and run.ranks[0] else None


def check_padding(ctx, run, default) -> None:
    """TODO 60: the default pads to a multiple of 64 (the one-step run, which keeps the
    default); --pad-vocab 1 does not pad (the main run)."""
    rep = ctx.report
    corpus = run.summary.get("data_vocab_size")
    padded, plain = vocab_of(default), vocab_of(run)
    if padded is None or plain is None:
        return  # a run that crashed is reported elsewhere
    has_flag = "--pad-vocab" not in run.ranks[0].get("parser", {}).get("missing", [])
    if not has_flag and padded == plain == (corpus or plain):
        return  # not started: the data's vocabulary, no option
    rep.attempt(60)
    if not has_flag:
        rep.fail(60, "there is no --pad-vocab option yet: parser.add_argument('--pad-vocab', "
                 "type=positive_int, default=64)")
    elif padded % PAD or padded < plain:
        rep.fail(60, f"the model's vocabulary is {padded} by default: "
                 f"padded_vocab(corpus.vocab_size, args.pad_vocab) rounds {plain} up to a "
                 f"multiple of {PAD} ({-(-plain // PAD) * PAD})")
    elif corpus and plain > corpus and padded - plain < PAD:
        rep.fail(60, f"--pad-vocab 1 gives a vocabulary of {plain}, the data has {corpus}: "
                 "every vocabulary is a multiple of 1, and one that is a multiple already "
                 "stays as it is; round up, -(-vocab_size // multiple) * multiple")
    elif padded - plain >= PAD:
        rep.fail(60, f"{plain} words padded to {padded}: round up to the next multiple, not "
                 "past it")
    elif corpus and plain != corpus:
        rep.fail(60, f"--pad-vocab 1 gives a vocabulary of {plain}, the data has {corpus}: "
                 "a multiple of 1 is the vocabulary itself")
    else:
        rep.ok(60, f"the vocabulary is padded to {padded} (a multiple of {PAD}), and "
               "--pad-vocab 1 leaves it as it is")


def check_loss_compiled(ctx, run, compiled) -> None:
    """TODO 61: with --compile (default mode) the loss is compiled too and used."""
    rep = ctx.report
    if not compiled.ranks or not compiled.ranks[0]:
        return
    functions = [c for c in compiled.ranks[0].get("compile_calls", []) if not c["module"]]
    unasked = [c for c in run.ranks[0].get("compile_calls", []) if not c["module"]]
    used = compiled.ranks[0].get("compiled_function_calls", {})
    # a compiled function the step calls and that returns one number: the loss, whatever its
    # name (lm_loss, or a function of the script's own under @torch.compile)
    losses = compiled.ranks[0].get("compiled_losses", [])
    if not functions and not unasked:
        return
    rep.attempt(61)
    if unasked:
        rep.fail(61, f"{unasked[0]['what']} is compiled without --compile: "
                 "loss_fn = torch.compile(lm_loss) if args.compile else lm_loss")
    elif losses:
        rep.ok(61, f"--compile compiles the loss too ({losses[0]}), and the step uses it")
    elif not any(c["what"] == "lm_loss" for c in functions):
        rep.fail(61, f"--compile compiles {', '.join(c['what'] for c in functions)}, not the "
                 "loss: loss_fn = torch.compile(lm_loss), used for the training loss")
    elif not used.get("lm_loss"):
        rep.fail(61, "the compiled loss is never called: the step computes its loss with "
                 "loss = loss_fn(logits, y), loss_fn the compiled lm_loss")
    else:
        rep.ok(61, "--compile compiles the loss too (lm_loss), and the step uses it")


def check_ddp_for_one_process(ctx, run, fast) -> None:
    """TODO 62: one process trains without DDP; two ranks still with it."""
    rep = ctx.report
    one, two = fast.ranks[0].get("ddp", []), run.ranks[0].get("ddp", [])
    if one and two and rep.status.get(62) == "not started":
        return  # DDP everywhere, as shipped
    rep.attempt(62)
    if not two:
        rep.fail(62, "two ranks train without DDP, so their gradients are never averaged: "
                 "wrap when world_size > 1")
    elif one:
        rep.fail(62, "one process still wraps the model in DDP: if world_size > 1: model = DDP(...)")
    else:
        rep.ok(62, "one process trains without DDP, two ranks with it")


def check_plain_compile(ctx, short) -> None:
    """TODO 61/63: --compile alone compiles in torch.compile's default mode. CUDA graphs are
    --compile-mode reduce-overhead's, asked for: they hold their memory and replay
    outputs that the next call overwrites."""
    record = (short.ranks[0] or {}) if short.ranks and not short.crashed else {}
    default = (record.get("parser", {}).get("defaults") or {}).get("compile_mode")
    other = [c for c in record.get("compile_calls", []) if c["mode"] not in (None, "default")]
    if default not in (None, "default") and other:
        ctx.report.fail(63, f"--compile-mode defaults to {default!r}, so --compile alone "
                        "compiles with CUDA graphs: default=None (torch.compile's own mode), "
                        "CUDA graphs only where --compile-mode reduce-overhead asks for them")
    elif other:
        what = other[0]["what"]
        todo = 61 if not other[0]["module"] else 47
        ctx.report.fail(todo, f"--compile alone compiles {what} in mode {other[0]['mode']!r}: "
                        "with --compile, torch.compile's default mode; another mode only where "
                        "--compile-mode asks for it (TODO 63), "
                        + ("torch.compile(lm_loss)" if todo == 61 else "compile_blocks(model)")
                        + " here")


def mode_given(run) -> str:
    """The --compile-mode the run got: the check's, or its fallback where the script's choices
    leave the check's out."""
    parser = (run.ranks[0] or {}).get("parser", {}) if run.ranks else {}
    return (parser.get("substituted") or {}).get("--compile-mode", COMPILE_MODE)


def check_compile_mode(ctx, fast, run, gpu) -> None:
    """TODO 63: --compile-mode reaches every torch.compile call, the blocks' and the loss's,
    and compiles nothing without --compile (the stand-in GPU run gives the mode alone)."""
    rep = ctx.report
    alone = (gpu.ranks[0] or {}).get("compile_calls", []) if gpu.ranks and not gpu.crashed \
        else []
    unasked = (run.ranks[0] or {}).get("compile_calls", [])  # (TODO 61's, without any option)
    if alone and not unasked:
        rep.attempt(63)
        rep.fail(63, f"--compile-mode {mode_given(gpu)} without --compile compiles "
                 f"{alone[0]['what']}: the mode changes how --compile compiles, so compile "
                 "again in it only with --compile, if args.compile and args.compile_mode ...")
        return
    calls = fast.ranks[0].get("compile_calls", [])
    has_flag = "--compile-mode" not in fast.ranks[0].get("parser", {}).get("missing", [])
    if not has_flag or ctx.extra.get("whole_model_compiled"):
        return  # not started, or waits for TODO 47
    rep.attempt(63)
    asked = mode_given(fast)
    modes = {c["what"]: c["mode"] for c in calls}
    # a function compiled at --compile and never called afterwards (replaced by the same loss
    # compiled in the mode asked for) does not count
    used = fast.ranks[0].get("compiled_function_calls", {})
    functions = {c["what"] for c in calls if not c["module"]}
    wrong = [what for what, mode in modes.items() if mode != asked
             and (what not in functions or used.get(what))]
    if not calls:
        rep.fail(63, "--compile compiled nothing: compile_blocks(model, args.compile_mode) with "
                 "--compile")
    elif wrong:
        mode = modes[wrong[0]]
        rep.fail(63, f"with --compile-mode {asked}, {' and '.join(wrong)} compiled in "
                 f"{'the default mode' if mode in (None, 'default') else 'mode ' + str(mode)}: "
                 "compile the blocks and the loss again in the mode asked for, "
                 "compile_blocks(model, args.compile_mode) and torch.compile(lm_loss, "
                 "mode=args.compile_mode)")
    else:
        rep.ok(63, f"--compile-mode reaches every compiled part ({', '.join(modes)})")


# ------------------------------------------------------------------ what only a GPU would show
def check_on_a_gpu(ctx, run, gpu, profiling) -> None:
    """TODOs 42-46 as they would run on a GPU: the stand-in run (selfcheck/standin.py) takes
    the script's `cuda` branches and records what they build and in which order."""
    rep = ctx.report
    if gpu.crashed:
        f = gpu.failure
        if standin.beyond_the_standin(f):
            rep.note(f"(the check's stand-in GPU could not follow line {f.line}: {f.message}; "
                     "what only a GPU shows is not judged)")
        elif not run.crashed and f is not None:
            todo = crash_todo(ctx, f)
            if todo in rep.names and not rep.failed(todo):
                rep.fail(todo, f"on a GPU (the check's stand-in) the run would stop"
                         f"{f.where()} with: {f.message}")
                rep.note(f"(full output of the stand-in GPU run: {gpu.dir / 'output.txt'})")
        return
    seen = standin.observed(gpu)
    if not seen:
        return
    record = gpu.ranks[0]
    monitor = monitor_lines(record)

    def is_report(text):
        return bool(RATE.search(text) and (MFU.search(text) or STEP.search(text))) and not any(
            m and m in text for m in monitor)

    # TODO 42: the clock read after the GPU finished the step's work
    late = standin.clock_reads_before_sync(seen, is_report)
    if late and not rep.failed(42):
        rep.fail(42, f"line {late[0]} reads the clock while a GPU may still be working on the "
                 "step (no synchronize(device) between the optimizer step and it): the time "
                 "would count only the queueing; call synchronize(device) right before reading "
                 "the clock")
    elif not rep.failed(42) and rep.judged(42):
        rep.ok(42, "on a GPU, synchronize(device) comes before every clock read of a report")
    # TODO 43: on a GPU the profiler records the kernels and sorts its table by them
    state = seen.get("profiler", {})
    if profiling and state.get("started") and not rep.failed(43):
        steps = sum(1 for e in seen.get("timeline", []) if e["kind"] == "step")
        activities = state.get("activities") or [[]]
        sorts = [t.get("sort_by") for t in record.get("tables", [])]
        if activities[0] and "CUDA" not in activities[0]:
            rep.fail(43, f"on a GPU the profiler records only {', '.join(activities[0])}: no "
                     "kernel, no NCCL in the trace; add ProfilerActivity.CUDA when "
                     "device.type == 'cuda'")
        elif state.get("steps") != steps:
            rep.fail(43, f"with a report every 2nd step the profiler was stepped "
                     f"{state.get('steps')} times in {steps} training steps: profiler.step() "
                     "once after every training step, outside the `if step % args.log_every` "
                     "block")
        elif sorts and any(s in ("device_time_total", "cuda_time_total") for s in sorts):
            rep.fail(43, f"on a GPU the operator table is sorted by {sorts[0]}, which counts "
                     "each kernel again in every operator above the one that launched it: "
                     "sort by the time each operator itself took on the GPU, "
                     "sort_by='self_device_time_total'")
        elif sorts and not any(s in standin.DEVICE_SORT_KEYS for s in sorts):
            rep.fail(43, f"on a GPU the operator table is sorted by {sorts[0]}, the CPU's time "
                     "to launch the kernels: sort_by='self_device_time_total' when "
                     "device.type == 'cuda'")
        elif not state.get("stopped"):
            rep.fail(43, "on a GPU the profiler is never stopped: profiler.stop() after the "
                     "training loop")
    # TODO 44: NVTX ranges for Nsight Systems, next to the profiler's ranges
    nvtx = {n.lower() for n in seen.get("nvtx", [])}
    if profiling and rep.judged(44) and not rep.failed(44):
        missing = [phase for phase, words in PHASES.items()
                   if not any(any(w in n for w in words) for n in nvtx)]
        traces = sorted((gpu.out / "profile").glob("rank0.*.pt.trace.json")) if (
            gpu.out / "profile").is_dir() else []
        names = {n for t in traces[-1:] for n in user_ranges(trace_events(t))}
        if not nvtx:
            rep.fail(44, "on a GPU no NVTX range is opened: Nsight Systems would show none; in "
                     "annotate(), also torch.cuda.nvtx.range(name) when device.type == 'cuda'")
        elif missing:
            rep.fail(44, f"on a GPU the NVTX ranges ({', '.join(sorted(nvtx))}) leave out "
                     f"{', '.join(missing)}: the same ranges as record_function's")
        elif seen.get("nvtx_open"):
            rep.fail(44, f"on a GPU {seen['nvtx_open']} NVTX ranges are still open when the "
                     "run ends: torch.cuda.nvtx.range_push(name) without range_pop() (or "
                     "range_start without range_end) leaves a range open to the end of the run, "
                     "and Nsight Systems nests every later range inside it; open it as the "
                     "context manager torch.cuda.nvtx.range(name), which closes it with the "
                     "phase")
        elif traces and not any(any(w in n.lower() for ws in PHASES.values() for w in ws)
                                for n in names):
            rep.fail(44, "on a GPU the profiler's trace has no named range: record_function("
                     "name) on every device, NVTX only in addition")
    # TODO 45: --precision auto means bf16 on a GPU that has it
    if rep.judged(45) and not rep.failed(45):
        precision = (gpu.summary or {}).get("precision")
        dtypes = record.get("forward_dtypes", [])
        if precision != "bf16":
            rep.fail(45, f"with the default --precision auto a GPU with bf16 runs in "
                     f"{precision}: args.precision = set_precision(args.precision, device) "
                     "(it turns auto into bf16 there) before anything reads args.precision")
        elif "bfloat16" not in dtypes and "auto" in seen.get("autocast_asked", []):
            rep.fail(45, "with --precision auto, autocast gets args.precision = 'auto' and does "
                     "nothing: a GPU would compute in float32; keep what set_precision returns, "
                     "args.precision = set_precision(args.precision, device)")
        elif "bfloat16" not in dtypes:
            rep.fail(45, "with --precision auto a GPU would compute in float32: "
                     "autocast(args.precision, device) around the forward pass and the loss, "
                     "with args.precision as set_precision returned it")
        else:
            rep.ok(45, "--precision auto runs bf16 under autocast on a GPU")
    # TODO 46: the fused AdamW where it exists
    adamw = seen.get("adamw", [])
    if adamw and not rep.failed(46):
        if adamw[0].get("fused") is True:
            rep.ok(46, "on a GPU AdamW is fused (one kernel for all parameters)")
        else:
            given = adamw[0].get("fused", "not given")
            rep.fail(46, f"on a GPU AdamW gets fused={given}: the test must be true there, "
                     "fused=device.type == 'cuda'")


HINTS = {
    41: ("Measuring, profiling and the fixes each need something new.",
         "synchronize and peak_flops from utils.metrics; torch.profiler (profile, schedule, "
         "record_function, ProfilerActivity, tensorboard_trace_handler); contextlib; autocast "
         "and compile_blocks from utils.precision."),
    42: ("tokens/s of each interval between reports, and MFU: the FLOPs those tokens cost over "
         "what all devices could do. A GPU runs behind Python: wait for it before reading the "
         "clock. Say what MFU divides by.",
         "peak, source = peak_flops(device, args.precision) (printed once); count "
         "x.numel() * world_size per step; synchronize(device) before time.perf_counter(); "
         "MFU = rate * flops_per_tok / (peak * world_size)."),
    43: ("A profiler records a few steps after a warm-up and writes one trace per rank; a run "
         "too short for that window says so. Print the most expensive operators.",
         "profiler_window / make_profiler with torch.profiler.profile(schedule=schedule(wait, "
         "warmup, active), on_trace_ready=tensorboard_trace_handler(...)); profiler.step() "
         "after each step; profiler.stop() and key_averages().table(sort_by=...)."),
    44: ("Named ranges make the phases of a step visible in the trace (record_function) and, on "
         "a GPU, in Nsight Systems (NVTX).",
         "annotate(name, device): a contextlib.ExitStack with record_function(name), plus "
         "torch.cuda.nvtx.range(name) on CUDA; around forward+loss, backward, the optimizer "
         "step and the loss all-reduce."),
    45: ("Honour --precision: bf16 runs the matmuls in bfloat16 under autocast while the "
         "weights stay float32 (the optimizer needs their precision).",
         "args.precision = set_precision(args.precision, device); with autocast(args.precision, "
         "device): around the forward pass and the loss only."),
    46: ("The default AdamW launches several kernels per parameter; the fused one updates all "
         "parameters in one.",
         "torch.optim.AdamW(..., fused=device.type == 'cuda')."),
    47: ("torch.compile fuses a block's operations into fewer kernels; only when asked for, and "
         "before DDP wraps the model.",
         "if args.compile: compile_blocks(model)."),
    59: ("A profile says how long the kernels ran and how long each step took on the CPU: when "
         "the kernels fill only part of a step, the GPU waits for Python to launch the next.",
         "gpu_busy(profiler): over profiler.key_averages(), the sum of e.self_device_time_total "
         "of the rows with e.device_type != DeviceType.CPU and not e.is_user_annotation (each "
         "kernel has a row of its own, and its time is in the row of the CPU operator that "
         "launched it too: sum the kernels' rows only), and e.cpu_time_total of the CPU's "
         "'ProfilerStep*' row (a GPU has a second one), each divided by that row's count (the "
         "steps); print both after the table (no kernels: a CPU run)."),
    60: ("Tensor cores read aligned tiles: an output layer as wide as an odd vocabulary runs in "
         "slower kernels. A few never-used extra words make it a multiple of 64.",
         "padded_vocab(vocab_size, multiple) = ceil(vocab_size / multiple) * multiple; "
         "--pad-vocab (default 64) and get_config(..., vocab_size=padded_vocab(corpus.vocab_size, "
         "args.pad_vocab))."),
    61: ("The logits are the largest activation of the model, and cross_entropy passes over "
         "them several times: compiled, those passes fuse.",
         "loss_fn = torch.compile(lm_loss) if args.compile else lm_loss, and "
         "loss = loss_fn(logits, y) in the step."),
    62: ("With one process DDP averages nothing, but still copies every gradient into its "
         "buckets and launches their all-reduces.",
         "if world_size > 1: model = DDP(model, device_ids=...)."),
    63: ("CUDA graphs record a compiled piece's kernels once and replay them with one launch: "
         "torch.compile's mode 'reduce-overhead'.",
         "--compile-mode (choices default, reduce-overhead, max-autotune, "
         "max-autotune-no-cudagraphs); with --compile and another mode than default: "
         "compile_blocks(model, args.compile_mode) and loss_fn = torch.compile(lm_loss, "
         "mode=args.compile_mode) again."),
}
