"""The performance step's job file, perf_training.sbatch (TODO 48): Nsight Systems on demand.

The file runs as sbatch would run it (stand-ins for srun and nsys), without NSYS, with NSYS=1,
and with NSYS=1 again into the same output folder (a requeued job: nsys refuses to overwrite a
report unless told to).
"""

from __future__ import annotations

from selfcheck import slurm
from selfcheck.steps.sbatch import stopped

FILE = "perf_training.sbatch"
WHAT = "the performance job file: Nsight Systems"
NEEDS_TORCH = False  # bash and the stand-ins for Slurm only
TODOS = {48: "Nsight Systems"}
ARGS = ("--max-steps", "5")


def show(script, work) -> list[str]:
    return slurm.describe(slurm.submit(script, work, args=ARGS, env_extra={"NSYS": "1"}),
                          script.read_text())


def option(words, *names):
    for i, a in enumerate(words):
        key = a.split("=", 1)[0]
        if key in names:
            return a.split("=", 1)[1] if "=" in a else (words[i + 1] if i + 1 < len(words) else "")
    return None


def check(ctx) -> None:
    rep = ctx.report
    plain = slurm.submit(ctx.script, ctx.work, job_id="4244", args=ARGS)
    if stopped(ctx, plain, 48):
        return
    out = ctx.work / "requeued-out"
    nsys = slurm.submit(ctx.script, ctx.work, job_id="4245", args=ARGS, env_extra={"NSYS": "1"},
                        out_dir=out)
    again = slurm.submit(ctx.script, ctx.work, job_id="4245", args=ARGS, env_extra={"NSYS": "1"},
                         out_dir=out)
    runs = nsys.of("nsys")
    if plain.of("nsys"):
        rep.fail(48, "nsys runs without NSYS=1: fill PROFILER only inside "
                 "if [ \"${NSYS:-0}\" = 1 ]; then ... fi")
        rep.attempt(48)
        return
    if not runs:
        glued = [w for r in nsys.of("srun") for w in r["args"]
                 if w.split()[:1] == ["nsys"] and len(w.split()) > 1]
        if glued:  # a string, not an array: "${PROFILER[@]}" is then one word, one program
            rep.attempt(48)
            rep.fail(48, f"srun got `{glued[0]}` as one word, a program of that name: "
                     "PROFILER=(nsys profile ...) as a bash array, so that "
                     "\"${PROFILER[@]}\" gives one word per option")
        elif nsys.returncode:
            stopped(ctx, nsys, 48)
        else:
            rep.fail(48, "with NSYS=1 srun does not start nsys: PROFILER=(nsys profile ...), then "
                     "srun ... \"${PROFILER[@]}\" python -u \"$SCRIPT\" \"${ARGS[@]}\"")
        return
    rep.attempt(48)
    words = runs[0]["args"]
    trace = option(words, "-t", "--trace") or ""
    report = option(words, "-o", "--output") or ""
    launcher = next((w for w in words if w.rsplit("/", 1)[-1] in ("srun", "mpirun", "torchrun")),
                    None)
    if launcher:
        rep.fail(48, f"nsys runs {launcher}, not the training (it profiles the launcher on one "
                 "node only): nsys goes inside the srun line, after srun's options and before "
                 "python: srun ... \"${PROFILER[@]}\" python -u \"$SCRIPT\" ...")
    elif words[:1] != ["profile"] or "python" not in words or "--max-steps" not in words:
        rep.fail(48, f"nsys got `{' '.join(words)}`: nsys profile [its options] python -u "
                 "\"$SCRIPT\" \"${ARGS[@]}\"")
    elif not {"cuda", "nvtx"} <= set(trace.split(",")):
        rep.fail(48, f"nsys records {trace or 'its default'}: -t cuda,nvtx,nccl (the kernels, "
                 "the script's ranges and the NCCL calls)")
    elif not report.startswith(str(out) + "/"):
        rep.fail(48, f"the report goes to {report or 'the current folder'}: -o \"$OUT_DIR/nsys\", "
                 "next to the run's other output")
    elif again.returncode != 0:
        rep.fail(48, "a requeued job (same OUT_DIR) fails: nsys will not overwrite the report "
                 "of the first run: --force-overwrite=true")
    else:
        rep.ok(48, f"NSYS=1 runs the training under nsys profile -t {trace}, report in OUT_DIR, "
               "overwritten when the job runs again")


HINTS = {
    48: ("Nsight Systems records the kernels, the script's NVTX ranges and NCCL on one "
         "timeline; only when asked (NSYS=1), into the run's folder, overwriting a report of "
         "a requeued job.",
         "if [ \"${NSYS:-0}\" = 1 ]; then PROFILER=(nsys profile -t cuda,nvtx,nccl -o "
         "\"$OUT_DIR/nsys\" --force-overwrite=true); fi, and \"${PROFILER[@]}\" before python "
         "in the srun line."),
}
