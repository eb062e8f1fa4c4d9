"""Draw a pipeline run's schedule as it ran, next to the theory's, from its folder.

    python tools/pipeline_timeline.py RUN_DIR        # RUN_DIR/pipeline_schedule.png and .html
    python tools/pipeline_timeline.py --schedule zero-bubble --ranks 4 --microbatches 8 --out DIR
                                                     # the theory alone, in units of a forward

Every run of train/pp_training.py and train/nd_training.py writes RUN_DIR/pipeline_schedule.json
(the recorded timestamps of a typical step of every stage and the predicted step; see
utils/pipeline_timeline.py) and draws it at the end; this command draws it again, for a run
whose drawing failed (no matplotlib on the cluster) or was copied home as JSON only.
The second form draws what torch's schedule would do with equal stages (a forward 1 unit, a
backward 2, a zero-bubble schedule's input and weight gradients 1 each) and no communication.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from utils.pipeline_timeline import (FILES, SCHEDULE_CLASSES, bubble_formula,  # noqa: E402
                                     idle_share, schedule_order, simulate, stage_ids,
                                     write_drawing)


def theory_record(schedule: str, ranks: int, microbatches: int, stages_per_rank: int) -> dict:
    """A record as pipeline_schedule.json holds it, with the prediction only (unit times)."""
    timeline = simulate(schedule_order(SCHEDULE_CLASSES[schedule], ranks, microbatches,
                                       stages_per_rank))
    formula, text = bubble_formula(schedule, ranks, microbatches, stages_per_rank)
    return {"schedule": schedule, "schedule_class": SCHEDULE_CLASSES[schedule], "ranks": ranks,
            "stages_per_rank": stages_per_rank, "num_stages": ranks * stages_per_rank,
            "microbatches": microbatches, "device": "none: the theory", "time_unit": "forward",
            "stages": [stage_ids(r, ranks, stages_per_rank) for r in range(ranks)],
            "bubble_formula": formula, "formula": text, "step": None, "measured": None,
            "predicted": [[list(a) for a in row] for row in timeline],
            "bubble_measured": None, "bubble_predicted": idle_share(timeline),
            "step_s_measured": None,
            "step_s_predicted": max(a[4] for row in timeline for a in row),
            "idle_per_rank": None, "compute_s": {}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", nargs="?", type=Path, help="a run's --out-dir")
    p.add_argument("--schedule", choices=list(SCHEDULE_CLASSES), help="draw the theory alone")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--stages-per-rank", type=int, default=None,
                   help="default: 2 for interleaved-1f1b, else 1")
    p.add_argument("--out", type=Path, default=Path("."), help="where the theory's files go")
    args = p.parse_args(argv)
    if (args.run_dir is None) == (args.schedule is None):
        p.error("give a RUN_DIR, or --schedule (with --ranks, --microbatches) for the theory")
    if args.schedule:
        v = args.stages_per_rank or (2 if args.schedule == "interleaved-1f1b" else 1)
        if min(args.ranks, args.microbatches, v) < 1:
            p.error("--ranks, --microbatches and --stages-per-rank must be at least 1")
        try:
            record = theory_record(args.schedule, args.ranks, args.microbatches, v)
        except (ValueError, RuntimeError) as e:
            p.error(f"torch cannot build {args.schedule} for these numbers: {e}")
        args.out.mkdir(parents=True, exist_ok=True)
        write_drawing(args.out, record)
        return 0
    source = args.run_dir / FILES[0]
    if not source.is_file():
        p.error(f"{source} does not exist: give the --out-dir of a pipeline run "
                "(train/pp_training.py or train/nd_training.py) that finished")
    try:
        record = json.loads(source.read_text())
    except (OSError, ValueError) as e:
        p.error(f"{source} cannot be read as JSON ({e}): the run's drawing data is damaged")
    written = write_drawing(args.run_dir, record)
    return 0 if len(written) == len(FILES) else 1


if __name__ == "__main__":
    sys.exit(main())
