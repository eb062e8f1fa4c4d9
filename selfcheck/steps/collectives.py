"""The collectives lesson, train/collectives.py (TODOs 49-54): a ring all-reduce by hand, the
alpha-beta model, DDP's all-reduce per step, and the time a profiler trace shows.

Your script runs as 3 ranks on one node (with 2, left and right are the same neighbour and a
ring that sends the wrong way still works), with a made-up profiler trace as --trace. The probe
calls your functions with inputs whose answers are known (selfcheck/probe.py, the block of the
collectives lesson): one send/receive step, the reduce-scatter and the all-gather each on their
own (with a correct send/receive step, so that each is judged apart), the whole ring on tensors
of several shapes and dtypes, the fit on exact times of a known latency and bus bandwidth, the
prediction for a known model, and the trace reading on a gloo and an NCCL trace.
"""

from __future__ import annotations

import itertools
import json
import re

from selfcheck import slurm
from selfcheck.compare import near
from selfcheck.probe import (LESSON_FIT, LESSON_PREDICT, least_squares, lesson_fit_times,
                             lesson_traces)
from selfcheck.runs import Geometry, Run
from selfcheck.steps.common import calls, report_crash

FILE = "train/collectives.py"
JOB_FILE = "collectives.sbatch"
WHAT = "collectives by hand: ring all-reduce, alpha-beta fit, DDP's all-reduce per step"
TODOS = {49: "send and receive", 50: "reduce-scatter", 51: "all-gather", 52: "alpha-beta fit",
         53: "DDP's all-reduce per step", 54: "all-reduce time in a trace"}
RING = Geometry(1, 3)
ARGS = ["--max-bytes", "16K", "--iters", "2", "--warmup", "1"]
FIRST_BUCKET, BUCKET = 2**20, 25 * 2**20
RING_PARTS = {"send_right_receive_left": 49, "ring_reduce_scatter": 50, "ring_all_gather": 51}
RING_CAUSE = ("in a ring every rank sends at the same moment: post the send and the receive "
              "together (batch_isend_irecv, or isend and irecv) before waiting, each rank sending "
              "to (rank + 1) % n and receiving from (rank - 1) % n, and the chunk received the "
              "one its left neighbour sends (same index, same size)")


def check(ctx) -> None:
    rep = ctx.report
    trace_dir = ctx.work / "perf-run"
    (trace_dir / "profile").mkdir(parents=True)
    trace, _ = lesson_traces()["cpu"]
    (trace_dir / "profile" / "rank0.1.pt.trace.json").write_text(json.dumps(trace))
    run = Run(ctx.work, "yours", ctx.script, 4, geometry=RING,
              extra=[*ARGS, "--trace", str(trace_dir)])
    # the job file that runs the lesson on two nodes (the one next to the checked file's train/
    # folder, else the repository's), with the stand-ins for Slurm
    job_file = next((p for p in (ctx.script.parent.parent / JOB_FILE, ctx.root / JOB_FILE)
                     if p.is_file()), None)
    if job_file is not None:
        slurm.judge_job_file(rep, JOB_FILE, job_file, ctx.work)
    run.wait()
    # what the probe found out before a crash comes first (gloo aborts a rank that receives
    # a message of the wrong size: its record is lost, the others' are kept)
    lessons = [r["lesson"] for r in run.ranks if r and r.get("lesson")]
    check_peers(ctx, run)
    if lessons:
        check_fit(ctx, lessons[0].get("fit"))
        check_noisy_fit(ctx, lessons[0].get("fit_noisy"))
        check_prediction(ctx, lessons[0].get("predict"))
        check_trace(ctx, lessons[0].get("trace"))
        rings = {lesson["ring"]["rank"]: lesson["ring"] for lesson in lessons
                 if lesson.get("ring")}
        if rings:
            check_ring(ctx, run, rings)
    check_requests(ctx, run)
    if run.crashed:
        failure = run.failure
        in_ring = failure is not None and failure.func in RING_PARTS
        if rep.failed(49) and (in_ring or failure is None or failure.waiting):
            pass  # every part sends with send_right_receive_left: 50 and 51 wait for TODO 49
        elif check_steps(ctx, run):
            pass
        elif failure is not None and check_sizes(ctx, run, failure):
            pass
        elif not (in_ring and rep.failed(RING_PARTS[failure.func])):  # else: said more exactly
            adding = re.search(r"The size of tensor a \(\d+\) must match", failure.message)
            report_crash(ctx, run, cause=(
                "a received chunk added into a chunk of another size: add it into the chunk "
                "it was received for, chunks[into] += received (into = (rank - s - 1) % n)"
                if in_ring and adding else RING_CAUSE if in_ring and (
                    failure.kind in ("hung", "timeout") or failure.peer or "size" in
                    failure.message) else None))
        rep.note(f"(full output: {run.dir / 'output.txt'})")


# ------------------------------------------------------------------------------ the ring
SIZE_MISMATCH = re.compile(r"(\d+) vs (\d+)\. Received data size doesn't match|size mismatch",
                           re.I)


def check_requests(ctx, run) -> None:
    """A request of isend or irecv that the script never waited for (dropped, it can cancel
    the message: its receiver then waits forever)."""
    rep = ctx.report
    for record in run.ranks:
        for entry in (record or {}).get("requests", []):
            if entry["waited"] or not entry.get("dropped"):
                continue
            todo = RING_PARTS.get(entry["func"]) or ctx.todo_of(entry["line"])
            if todo in rep.names and not rep.failed(todo):
                rep.fail(todo, f"line {entry['line']} ({entry['func']}) never waits for the "
                         f"request dist.{entry['name']} returns: keep every request of isend "
                         "and irecv (or all that batch_isend_irecv returns) and wait() for each, "
                         "the send's too; a request dropped unwaited can cancel its message, and "
                         "the other rank waits forever")
                rep.attempt(todo)
            return


def check_peers(ctx, run) -> None:
    """A send to (or a receive from) a rank that does not exist: rank + 1 on the last rank,
    rank - 1 on rank 0, without % n. gloo then waits for it until its store times out, or ends
    the process; either way the crash that follows is this mistake's."""
    rep = ctx.report
    outside = []
    for rank in range(RING.world):  # written at once: gloo may end the process in the call
        f = run.dir / "dump" / f"peers{rank}.json"
        try:
            outside += json.loads(f.read_text()) if f.is_file() else []
        except ValueError:
            continue
    outside.sort(key=lambda e: (e["name"] != "isend", e["rank"]))
    if not outside:
        return
    e = outside[0]
    todo = RING_PARTS.get(e["func"]) or ctx.todo_of(e["line"])
    if todo not in rep.names or rep.failed(todo):
        return

    def said(p):
        verb = "sends to" if p["name"] == "isend" else "receives from"
        return f"rank {p['rank']} {verb} rank {p['peer']} (line {p['line']})"
    other = next((o for o in outside if o["name"] != e["name"]), None)
    rep.fail(todo, f"on {e['world_size']} ranks, {said(e)}"
             + (f" and {said(other)}, which do not exist" if other else ", which does not exist")
             + ": the ranks are 0 to n - 1 and the ring closes, so wrap "
             "around with % n: right = (rank + 1) % n, left = (rank - 1) % n")
    rep.attempt(todo)


# the parts the probe runs alone, in its order: (its name for it, the function, the TODO)
PROBE_PARTS = (("reduce_scatter", "ring_reduce_scatter", 50),
               ("all_gather", "ring_all_gather", 51))


def check_steps(ctx, run) -> bool:
    """A rank that made fewer (or more) send/receive steps in a part than the others: it went
    on while a neighbour still waited in that part, and the messages that then met belong to
    different parts, so the error surfaces later and elsewhere. The probe writes each rank's
    steps per part as soon as the part ends (gloo's abort of a rank loses its record).
    True if reported."""
    rep = ctx.report
    steps = {}
    for rank in range(RING.world):
        f = run.dir / "dump" / f"ring{rank}.json"
        try:
            steps[rank] = json.loads(f.read_text()).get("steps", {}) if f.is_file() else {}
        except ValueError:
            continue
    for part, function, todo in PROBE_PARTS:
        made = {rank: s[part] for rank, s in steps.items() if part in s}
        if len(set(made.values())) < 2 or rep.failed(todo):
            continue
        counts = ", ".join(f"rank {r} made {m}" for r, m in sorted(made.items()))
        rep.fail(todo, f"the ranks make different numbers of steps in {function} ({counts}, "
                 f"n - 1 = {RING.world - 1}): a rank that stops early goes on to the next part "
                 "while its neighbour still waits for its message: n - 1 steps on every rank, "
                 "range(n - 1), with nothing that depends on the rank")
        rep.attempt(todo)
        return True
    return False


def check_sizes(ctx, run, failure) -> bool:
    """A message that arrived in a buffer of another size (gloo ends the receiving process):
    the chunk received is not the chunk the left neighbour sends. True if reported."""
    rep = ctx.report
    texts = [failure.message, *failure.others.values(), run.output]
    found = next((m for t in texts for m in [SIZE_MISMATCH.search(t or "")] if m), None)
    if found is None:
        return False
    parts = [f["func"] for f in failure.frames if f["func"] in RING_PARTS]
    outer = [p for p in parts if p != "send_right_receive_left"]
    function = outer[-1] if outer else (parts[-1] if parts else "send_right_receive_left")
    todo = RING_PARTS[function]
    sizes = ""
    if found.group(1):
        got, room = int(found.group(1)), int(found.group(2))
        sizes = (f": {got} bytes arrived in a buffer of {room} ({got // 4} elements into "
                 f"{room // 4})")
    who = f"rank {failure.rank}" if failure.rank is not None else "a rank"
    where = f" (line {failure.line})" if failure.line else ""
    if rep.failed(todo):
        return True
    # the chunks of one tensor differ by one element at most: bytes twice (or half) as many,
    # more than one element apart, are as many elements of another dtype (a float64 tensor
    # received into float32)
    if sizes and abs(got - room) > 8 and 2 in (got / room if room else 0, room / got):
        rep.fail(todo, f"in {function}{where} {who} received {got} bytes in a buffer of {room}: "
                 "as many elements, of another dtype (the ring also sums float64 tensors): make "
                 "the buffer with the chunk's dtype, torch.empty_like(chunks[into]), not "
                 "torch.zeros(shape) (float32)")
        rep.attempt(todo)
        return True
    rep.fail(todo, f"in {function}{where} {who} received a message of another size than its "
             f"buffer{sizes}: in each step the chunk a rank receives must be the one its left "
             "neighbour sends in that step, the same index on both sides: send chunk "
             "(rank - s) % n, receive into a buffer the size of chunk (rank - s - 1) % n (the "
             "chunks differ in size by one)" if todo == 50 else
             f"in {function}{where} {who} received a message of another size than its "
             f"buffer{sizes}: in step s send chunk (rank + 1 - s) % n and receive into chunk "
             "(rank - s) % n, the one the left neighbour sends in the same step" if todo == 51
             else f"in {function}{where} {who} received a message of another size than its "
             f"buffer{sizes}: receive into `recv` exactly, from (rank - 1) % n")
    rep.attempt(todo)
    return True


def collectives_in(run, function: str) -> list[str]:
    """The collectives (not point-to-point messages) a ring function of the script called."""
    names = ("dist.all_reduce", "dist.broadcast", "dist.all_gather", "dist.all_gather_single",
             "dist.all_gather_into_tensor", "dist.reduce_scatter", "dist.reduce_scatter_single",
             "dist.reduce_scatter_tensor", "dist.all_to_all", "dist.all_to_all_single",
             "dist.reduce", "all_reduce_sum", "all_reduce_mean")
    return sorted({c["name"] for name in names for c in calls(run, name)
                   if c["func"] == function})


def check_ring(ctx, run, rings: dict) -> None:
    """`rings`: rank -> what the probe found on that rank (the ranks that wrote a record)."""
    rep = ctx.report
    n = RING.world
    for function, todo in RING_PARTS.items():
        used = collectives_in(run, function)
        if used:
            rep.fail(todo, f"{function} calls {', '.join(used)}: the ring is made of "
                     "point-to-point messages only (isend/irecv to the neighbours)")
    # TODO 49: one step of the ring
    exchange = {rank: r["exchange"] for rank, r in rings.items() if r.get("exchange")}
    if exchange and not rep.failed(49):
        bad = next((r for r, e in exchange.items() if e["received"] != [e["left"]]), None)
        if bad is None and len(exchange) < n:
            pass  # a rank died before it could say: the crash is the news
        elif bad is None and all(e["sent_intact"] for e in exchange.values()):
            rep.ok(49, f"each of {n} ranks receives its left neighbour's tensor and sends its own "
                   "to the right")
        elif bad is None:
            rep.fail(49, "the tensor to send changed: send `send` as it is, receive into `recv`")
        else:
            e = exchange[bad]
            if e["received"] == [-1.0]:
                why = ("recv is never filled: post dist.irecv(recv, left) next to the send "
                       "(or a P2POp with dist.irecv in batch_isend_irecv) and wait() for both")
            elif e["received"] == [e["right"]]:
                why = ("it received from its right neighbour: send to (rank + 1) % n, receive "
                       "from (rank - 1) % n")
            elif e["received"] == [100.0 + bad]:
                why = "it received its own tensor: receive from the left neighbour, (rank - 1) % n"
            else:
                why = (f"it holds {e['received'][:3]}: send `send` to (rank + 1) % n and receive "
                       "`recv` from (rank - 1) % n, then wait() for both requests")
            rep.fail(49, f"on {n} ranks, rank {bad} should receive rank {(bad - 1) % n}'s "
                     f"tensor ({e['left']:g}), but {why}")
    # a part that makes the same number of steps on every rank, but not n - 1: with n its result
    # is right all the same (reduce-scatter: the extra step adds into a chunk the all-gather
    # overwrites; all-gather: it copies a complete chunk over itself), one step slower
    for part, function, todo in PROBE_PARTS:
        made = {r.get("steps", {}).get(part) for r in rings.values() if r.get(part)}
        if len(rings) == n and len(made) == 1 and None not in made and not rep.failed(todo) \
                and made != {n - 1}:
            steps = made.pop()
            rep.fail(todo, f"{function} makes {steps} send/receive steps on each of {n} ranks: a "
                     f"ring needs n - 1 = {n - 1}, range(n - 1): "
                     + ("after n - 1 steps each chunk has passed every rank once; each step more "
                        "has every rank send a chunk too many, a step's time for nothing"
                        if steps > n - 1 else "with fewer, a chunk has not passed every rank"))
            rep.attempt(todo)
    # TODO 50: the reduce-scatter (with a correct send/receive step)
    scatter = {rank: r["reduce_scatter"] for rank, r in rings.items() if r.get("reduce_scatter")}
    if len(scatter) == n and not rep.failed(50):
        wrong = [(r, s) for r, s in scatter.items() if s["expected"] not in s["complete"]]
        if not wrong:
            rep.ok(50, f"after it, rank r holds the complete sum of chunk (r + 1) % n ({n} ranks, "
                   "chunks of unequal sizes)")
        else:
            r, s = wrong[0]
            held, total = s.get("held") or [], s.get("sum") or []
            if s["expected"] in s["complete_in_list"]:
                why = ("the sum is only in the list: chunks[i] = chunks[i] + received makes a new "
                       "tensor; add in place, chunks[i] += received (the chunks are views)")
            elif held and len(held) == len(total) and all(
                    near(h, t / n, 1e-6, 1e-9) for h, t in zip(held, total, strict=True)):
                why = (f"it holds the sum divided by n = {n}, the mean: an all-reduce sums "
                       "(dist.all_reduce's default, ReduceOp.SUM), do not divide; averaging is "
                       "the caller's (DDP divides the gradients)")
            elif not s["changed"]:
                why = ("the tensor is unchanged: n - 1 steps, each sending chunk (rank - step) % n "
                       "and adding the received one to chunk (rank - step - 1) % n")
            elif s["complete"] == [r]:
                why = (f"it ends with the sum of chunk {r}, its own index: one step off: s "
                       "counts from 0 to n - 2 (range(n - 1)); the last step, s = n - 2, then "
                       "adds into chunk (rank - s - 1) % n = (rank + 1) % n")
            elif s["complete"]:
                why = (f"rank {r} ends with the sum of chunk {s['complete'][0]}, the all-gather "
                       f"expects chunk (rank + 1) % n = {s['expected']}: in step s send chunk "
                       "(rank - s) % n, add into chunk (rank - s - 1) % n")
            else:
                why = ("no chunk holds the whole sum: n - 1 steps (range(n - 1)), in step s send "
                       "chunk (rank - s) % n and add the received one into chunk "
                       "(rank - s - 1) % n")
            rep.fail(50, f"rank {r} should hold the sum over all ranks of chunk {s['expected']}: "
                     f"{why}")
    # TODO 51: the all-gather (from the state a right reduce-scatter leaves)
    gather = {rank: r["all_gather"] for rank, r in rings.items() if r.get("all_gather")}
    if len(gather) == n and not rep.failed(51):
        wrong = [(r, g) for r, g in gather.items() if g["wrong"]]
        if not wrong:
            rep.ok(51, "every rank ends with all n complete chunks")
        else:
            r, g = wrong[0]
            missing = sorted(set(range(n)) - set(g["complete"]))
            if set(range(n)) <= set(g.get("complete_in_list", [])):
                rep.fail(51, f"rank {r} ends without the complete chunk(s) {missing} in the "
                         "tensor, they are only in the list: chunks[into] = received replaces "
                         "the list's entry, and the chunks are views of the tensor: receive "
                         "straight into chunks[into] (or chunks[into].copy_(received))")
            else:
                rep.fail(51, f"rank {r} ends without the complete chunk(s) {missing}: n - 1 "
                         "steps, s = 0 to n - 2 (range(n - 1)), in step s send chunk "
                         "(rank + 1 - s) % n and receive into chunk (rank - s) % n (nothing to "
                         "add)")
    # the whole ring, with the script's own parts: its verdict belongs to the parts
    whole = [r["all_reduce"] for r in rings.values() if r.get("all_reduce")]
    if any(w["wrong"] for w in whole) and all(
            rep.judged(t) and not rep.failed(t) for t in RING_PARTS.values()):
        w = next(w for w in whole if w["wrong"])
        rep.fail(50, f"each part works alone, yet ring_all_reduce gets {w['wrong']} of "
                 f"{w['elements']} elements wrong (tensors {', '.join(w['failed'])}): the parts "
                 "must agree on which chunk goes where (the TODO comments' indices)")


# ------------------------------------------------------------------------------ the numbers
def returned(entry, todo, rep, what) -> object | None:
    if entry is None:
        rep.fail(todo, f"{what} is missing from the script")
        return None
    if "error" in entry and "process group has not been initialized" in entry["error"]:
        # called where no process group exists: it asked torch.distributed what it was given
        rep.fail(todo, f"{what} asks torch.distributed (dist.get_world_size()) and raised "
                 "'Default process group has not been initialized': it works on its arguments "
                 "alone; " + ("use its world_size argument, the ranks the times were measured on "
                              "(with --bench-json another run's, on another number of ranks)"
                              if todo == 52 else
                              "use its world_size argument, the ranks the prediction is for"
                              if todo == 53 else "read everything from the trace"))
        return None
    if "error" in entry:
        missing = re.match(r"KeyError: '(cat|dur|name)'", entry["error"])
        rep.fail(todo, f"{what} raised {entry['error']}" + (
            f" (a trace's metadata events have no {missing.group(1)!r}: "
            f"e.get({missing.group(1)!r}) where it may be missing)" if missing else ""))
        return None
    return entry["value"]


def check_fit(ctx, entry) -> None:
    rep = ctx.report
    f = LESSON_FIT
    n, want_latency, want_busbw = f["world_size"], f["latency"], f["busbw"]
    value = returned(entry, 52, rep, "fit_alpha_beta")
    if value is None:
        return
    case = (f"for all-reduce times of exactly {want_latency * 1e6:g} us + size / "
            f"{want_busbw * n / (2 * (n - 1)) / 1e9:g} GB/s on {n} ranks")
    if not isinstance(value, list) or len(value) != 2 or any(isinstance(v, str) for v in value):
        rep.fail(52, f"fit_alpha_beta returned {value}: return (latency, busbw) as two numbers")
        return
    latency, busbw = value
    if busbw != busbw:  # NaN: not done
        rep.fail(52, "fit_alpha_beta returns NaN: fit the line and return (latency, bus "
                 "bandwidth)")
        return
    algbw = want_busbw * n / (2 * (n - 1))
    if near(latency, want_busbw, 1e-3, 0) and near(busbw, want_latency, 1e-3, 1e-9):
        rep.fail(52, f"{case}: fit_alpha_beta returned ({latency:.4g}, {busbw:.4g}), the bus "
                 "bandwidth first: the two are swapped, return (latency, busbw)")
        return
    problems = []
    if not near(latency, want_latency, 1e-3, 1e-9):
        if near(latency, want_latency * 1e6, 1e-3):
            problems.append("the latency is in microseconds: return seconds")
        elif near(latency, want_latency * 1e3, 1e-3):
            problems.append("the latency is in milliseconds: return seconds")
        else:
            problems.append(f"the latency comes out {latency:.4g} s instead of {want_latency:g} "
                            "s: it is the line's intercept, mean y - slope x mean x")
    if not near(busbw, want_busbw, 1e-3, 0):
        ratio = busbw / want_busbw if want_busbw else 0
        if near(busbw, algbw, 1e-3, 0):
            problems.append("the bus bandwidth comes out as the algorithm bandwidth 1 / slope, a "
                            "factor of 1 (what 2 * (n - 1) // n gives: // rounds down): multiply "
                            "1 / slope by 2 (n - 1) / n, with /")
        elif near(ratio, 0.5, 1e-3, 0):
            problems.append("(n - 1) / n is the factor of all-gather and reduce-scatter; an "
                            "all-reduce moves twice that: 2 (n - 1) / n")
        elif near(ratio, 8, 1e-3, 0) or near(ratio, 1 / 8, 1e-3, 0):
            problems.append(f"the bus bandwidth comes out {ratio:g} x {want_busbw / 1e9:g} GB/s: "
                            "bytes per second, not bits (no factor of 8)")
        elif near(ratio, 1e-9, 1e-3, 0):
            problems.append("the bus bandwidth is in GB/s: return bytes per second")
        elif near(busbw, 1 / algbw, 1e-3, 0) or busbw < 1:
            problems.append("the bandwidth is 1 / slope, in bytes per second")
        else:
            problems.append(f"the bus bandwidth comes out {busbw / 1e9:.4g} GB/s instead of "
                            f"{want_busbw / 1e9:g}: least-squares slope of seconds against "
                            "bytes, bandwidth 1 / slope x 2 (n - 1) / n")
    if problems:
        rep.fail(52, f"{case}: " + "; ".join(problems))
    else:
        rep.ok(52, f"latency {want_latency * 1e6:g} us and bus bandwidth {want_busbw / 1e9:g} GB/s "
               f"recovered from exact times on {n} ranks")


def check_noisy_fit(ctx, entry) -> None:
    """Measured times are never on a line: the fit must be least squares through all points
    (a line through two of them, or a fit of some of them, follows their noise)."""
    rep = ctx.report
    if entry is None or rep.failed(52):
        return
    value = returned(entry, 52, rep, "fit_alpha_beta")
    if not isinstance(value, list) or len(value) != 2 or any(isinstance(v, str) or v != v
                                                              for v in value):
        if value is not None:
            rep.fail(52, f"on measured times (not exactly on a line) fit_alpha_beta returned "
                     f"{value}: return (latency, busbw) of the least-squares line")
        return
    f = LESSON_FIT
    n = f["world_size"]
    intercept, slope = least_squares(f["sizes"], lesson_fit_times(noisy=True))
    want_latency, want_busbw = intercept, (1 / slope) * 2 * (n - 1) / n
    latency, busbw = value
    if near(latency, want_latency, 1e-6, 1e-12) and near(busbw, want_busbw, 1e-6, 0):
        return
    rep.fail(52, f"on times a few per cent off a line (as measured times are) fit_alpha_beta "
             f"gives latency {latency * 1e6:.4g} us and bus bandwidth {busbw / 1e9:.4g} GB/s, "
             f"the least-squares line through all {len(f['sizes'])} points {want_latency * 1e6:.4g} "
             f"us and {want_busbw / 1e9:.4g} GB/s: fit every point by least squares (a line "
             "through two points follows their noise)")


def ddp_buckets(p: dict) -> list[int]:
    """The bucket sizes DDP forms for probe.lesson_model(p): in reverse order, a bucket closed
    at 1 MiB (the first) or 25 MiB (the others)."""
    sizes = [p["width"] * 4, p["width"] ** 2 * 4] * p["layers"]  # bias, weight of each layer
    buckets, size, limit = [], 0, FIRST_BUCKET
    for nbytes in sizes:
        size += nbytes
        if size >= limit:
            buckets.append(size)
            size, limit = 0, BUCKET
    return buckets + ([size] if size else [])


def check_prediction(ctx, entry) -> None:
    rep = ctx.report
    p = LESSON_PREDICT
    n, latency, busbw = p["world_size"], p["latency"], p["busbw"]
    buckets = ddp_buckets(p)
    grad, factor = sum(buckets), 2 * (n - 1) / n
    want = len(buckets) * latency + grad * factor / busbw
    value = returned(entry, 53, rep, "predict_ddp_allreduce_s")
    if value is None:
        return
    case = (f"for {len(buckets)} buckets of {', '.join(f'{b / 1e6:.1f}' for b in buckets)} MB on "
            f"{n} ranks, latency {latency * 1e3:g} ms, busbw {busbw / 1e9:g} GB/s")
    if not isinstance(value, float) or value != value:
        rep.fail(53, f"predict_ddp_allreduce_s returned {value}: return the seconds per step "
                 f"{case}")
        return
    if near(value, want, 1e-4, 0):
        rep.ok(53, f"{want * 1e3:.2f} ms per step {case}")
        return

    def time(latencies=None, per_byte=factor):
        latencies = len(buckets) if latencies is None else latencies
        return latencies * latency + grad * per_byte / busbw

    hints = [
        (time(per_byte=1), "each byte crosses each link 2 (n - 1) / n times in a ring "
         "all-reduce: bytes x 2 (n - 1) / n / busbw"),
        (time(per_byte=(n - 1) / n), "(n - 1) / n is the factor of an all-gather or a "
         "reduce-scatter; an all-reduce is both: 2 (n - 1) / n"),
        (time(latencies=1), f"one latency per bucket ({len(buckets)} all-reduces), not one per "
         "step"),
        (time(latencies=0), f"add the latency of each of the {len(buckets)} all-reduces"),
        (want * 1e3, "return seconds, not milliseconds"),
    ]
    why = next((text for guess, text in hints if near(value, guess, 1e-4, 0)),
               "the sum over the buckets of latency + bytes x 2 (n - 1) / n / busbw")
    rep.fail(53, f"predicted {value:.5g} s, expected {want:.5g} s {case}: {why}")


# why an event of the stand-in traces is no all-reduce to count, by (name, category)
NOT_ALL_REDUCES = {
    ("nccl:all_reduce", "user_annotation"): "nccl:all_reduce on the CPU only launches them",
    ("nccl:all_reduce", "gpu_user_annotation"): "nccl:all_reduce as gpu_user_annotation covers "
                                                "the kernels' time again",
    ("c10d::allreduce_", "cpu_op"): "c10d::allreduce_ only launches them",
}


def trace_reading(trace: dict, value: float) -> str | None:
    """What a function that returned `value` for `trace` did, part by part, where one way of
    reading the trace explains it best: the steps it divided by (all ProfilerStep#N events, the
    GPU's copies too, or none), the events it added up, the unit. Each way is tried: every set
    of (name, category) groups of events, every step count, seconds, ms or µs; of those that
    give `value`, the one with the fewest differences from the right reading, if only one has
    that few. None where none (or several) explain it."""
    events = trace["traceEvents"]
    marks = [e for e in events if e.get("name", "").startswith("ProfilerStep#")]
    right_steps = sum(e.get("cat") == "user_annotation" for e in marks)
    copies = sum(e.get("cat") == "gpu_user_annotation" for e in marks)
    groups: dict[tuple, list] = {}
    for e in events:  # (metadata events have no duration: nothing to add up)
        if not e.get("name", "").startswith("ProfilerStep#") and "dur" in e:
            groups.setdefault((e["name"], e.get("cat")), []).append(e["dur"])
    kernels = {k for k in groups if k[1] == "kernel" and "AllReduce" in k[0]}
    right = frozenset(kernels or {("gloo:all_reduce", "user_annotation")})
    found = []
    for size in range(1, len(groups) + 1):
        for chosen in itertools.combinations(groups, size):
            total = sum(sum(groups[k]) for k in chosen)
            for steps in {right_steps, len(marks), copies, 1} - {0}:
                for unit in (1e6, 1e3, 1):
                    if near(value, total / unit / steps, 1e-4, 1e-12):
                        chosen_set = frozenset(chosen)
                        differences = ((steps != right_steps) + (unit != 1e6)
                                       + len(chosen_set ^ right))
                        found.append((differences, steps, chosen_set, unit))
    if not found:
        return None
    found.sort(key=lambda f: f[0])
    if len(found) > 1 and found[1][0] == found[0][0]:
        return None
    differences, steps, chosen, unit = found[0]
    if differences == 0:
        return None
    parts = []
    if steps != right_steps:
        mark = ("ProfilerStep#N of category user_annotation only"
                + (", a GPU trace repeats them as gpu_user_annotation" if copies else ""))
        parts.append(f"not divided by the steps ({right_steps} in the trace: {mark})"
                     if steps == 1 else f"counted {steps} steps ({right_steps} in the trace: "
                     f"{mark})")
    if chosen != right:
        what = "the AllReduce kernels" if kernels else "gloo's gloo:all_reduce ranges"
        counted = sum(len(groups[k]) for k in chosen)
        wanted = sum(len(groups[k]) for k in right)
        why = [NOT_ALL_REDUCES.get(k, f"{k[0]} ({k[1]}) is no all-reduce")
               for k in sorted(chosen - right)]
        why += [f"without {what}"] if not right <= chosen else []
        parts.append(f"{counted} all-reduce events ({wanted}: {what} only; {', '.join(why)})")
    if unit != 1e6:
        parts.append("dur is in microseconds: divide by 1e6 for seconds")
    return "; ".join(parts)


def check_trace(ctx, entries) -> None:
    rep = ctx.report
    if entries is None:
        rep.fail(54, "allreduce_seconds_per_step is missing from the script")
        return
    traces = lesson_traces()
    wanted = {kind: want for kind, (_, want) in traces.items()}
    what = {"cpu": "a CPU (gloo) trace with 3 profiled steps",
            "gpu": "a GPU (NCCL) trace with 2 profiled steps"}
    hints = {  # kind -> [(wrong value, what to change)]
        "cpu": [(7e-3 * 3, "divide by the number of ProfilerStep#N events"),
                (7.0, "dur is in microseconds: divide by 1e6 for seconds"),
                (0.0, "on a CPU there are no kernels: count the gloo:all_reduce ranges"),
                (600e-6 / 3, "c10d::allreduce_ only launches the all-reduce: count the "
                 "gloo:all_reduce ranges (gloo's own thread)"),
                ((21000 + 600) / 1e6 / 3, "c10d::allreduce_ only launches the all-reduce: count "
                 "the gloo:all_reduce ranges alone")],
        "gpu": [(1e-3 * 2, "divide by the number of profiled steps"),
                (1e-3 / 2, "count the ProfilerStep#N events of category user_annotation only "
                 "(a GPU trace repeats them as gpu_user_annotation)"),
                (1.0, "dur is in microseconds: divide by 1e6 for seconds"),
                ((2000 + 1950) / 1e6 / 2, "count only the AllReduce kernels: nccl:all_reduce "
                 "(gpu_user_annotation) covers the same time again"),
                ((2000 + 180) / 1e6 / 2, "count only the AllReduce kernels: nccl:all_reduce "
                 "on the CPU only launches them"),
                ((2000 + 120) / 1e6 / 2, "count only the AllReduce kernels: c10d::allreduce_ "
                 "only launches them"),
                ((2000 + 900) / 1e6 / 2, "count the AllReduce kernels only (FSDP's AllGather "
                 "is another collective)"),
                (0.0, "on a GPU count the kernels (category kernel, AllReduce in the name)")]}
    problems, seen_nan = [], False
    for kind, want in wanted.items():
        entry = entries.get(kind)
        value = returned(entry, 54, rep, "allreduce_seconds_per_step")
        if value is None:
            return
        if not isinstance(value, float) or value != value:
            seen_nan = True
            continue
        if not near(value, want, 1e-4, 1e-12):
            why = next((text for guess, text in hints[kind] if near(value, guess, 1e-4, 1e-12)),
                       None) or trace_reading(traces[kind][0], value) or (
                "add up the durations of the all-reduces, divide by the profiled steps and by "
                "1e6")
            problems.append(f"{what[kind]}: {value:.4g} s per step instead of {want:g}: {why}")
    if seen_nan:
        rep.fail(54, "allreduce_seconds_per_step returns NaN: add up the all-reduce durations "
                 "and divide by the profiled steps")
    elif problems:
        rep.fail(54, "; ".join(problems[:2]))
    else:
        rep.ok(54, "7 ms per step from a gloo trace and 1 ms from an NCCL trace, launches and "
               "GPU copies of the ranges left out")


HINTS = {
    49: ("A ring step moves one tensor to the next rank while the previous rank's tensor "
         "arrives. If every rank first sent and then received, every rank would wait in its "
         "send for a receive that nobody posts yet.",
         "torch.distributed's non-blocking point-to-point calls, in send_right_receive_left: "
         "isend to the right neighbour and irecv from the left (or both as P2POps given to "
         "batch_isend_irecv); each returns a request: post both, then wait() for every one."),
    50: ("Reduce-scatter: the tensor is cut into n chunks; in n - 1 steps each chunk travels "
         "once around the ring, and every rank it passes adds its own part, so that after the "
         "last step each rank holds one chunk that has visited everybody.",
         "In ring_reduce_scatter: n - 1 calls of send_right_receive_left, one per step, with s "
         "counting from 0: s = 0, 1, ..., n - 2, range(n - 1) (from 1, every index is one step "
         "off); the chunk sent and the chunk added into move back by one each step (the TODO "
         "comment has their indices for step s); receive into a fresh buffer of that chunk's "
         "size (torch.empty_like) and add it in place, since the chunks are views of the "
         "tensor."),
    51: ("All-gather: every rank now has one complete chunk. n - 1 more steps pass them on "
         "around the ring until every rank has all of them; nothing is added any more.",
         "In ring_all_gather: n - 1 more calls of send_right_receive_left, s = 0, 1, ..., "
         "n - 2 again, each sending the chunk this rank completed last and receiving straight "
         "into the chunk its left neighbour completed (no buffer, no addition)."),
    52: ("The alpha-beta model: a message of S bytes takes latency + S / bandwidth. Measured "
         "times against sizes lie near a straight line; its intercept is the latency, its slope "
         "1 / (algorithm bandwidth). The bus bandwidth, what each link carried, is the "
         "algorithm bandwidth times 2 (n - 1) / n for an all-reduce.",
         "In fit_alpha_beta: an ordinary least-squares line through all the points, seconds "
         "against bytes (by hand from the means, as the TODO comment writes it, or "
         "statistics.linear_regression); its intercept is the latency; the slope gives the "
         "algorithm bandwidth, the all-reduce's factor turns that into the bus bandwidth."),
    53: ("DDP all-reduces the gradients bucket by bucket (ddp_bucket_bytes lists them). Each "
         "all-reduce pays the latency once and moves 2 (n - 1) / n of its bytes over each link.",
         "In predict_ddp_allreduce_s, over the buckets it already has: the alpha-beta time of "
         "one ring all-reduce per bucket (its latency, and its bytes times the ring's factor "
         "over the bus bandwidth), added up, in seconds."),
    54: ("A profiler trace is a list of events, each with a name, a category and a duration in "
         "microseconds. The all-reduce time is in the events that do the work (NCCL kernels on a "
         "GPU, gloo's ranges on a CPU), not in those that only launch them.",
         "In allreduce_seconds_per_step: filter trace['traceEvents'] by their 'cat' and 'name': "
         "the step markers (ProfilerStep#N, counted once: the CPU-side category), and the "
         "all-reduces (the kernels with AllReduce in the name, else gloo's own ranges); add up "
         "their 'dur' (microseconds) per profiled step."),
}
