"""Draw the slides' diagrams as plain SVG files in slides/figures/, from the course's own code.

Every figure that shows something the code decides is computed by calling that code, so a
figure and the code never disagree:
- data sharding: torch's DistributedSampler and our DistributedEvalSampler, called here;
- FSDP units: the modules that `apply_fsdp` (solutions/train/fsdp_training.py) hands to
  `fully_shard`, recorded by calling it on the workshop model built on the meta device;
- the tensor-parallel split: the plan that `apply_tp` (solutions/train/tp_training.py) hands
  to `parallelize_module`, recorded the same way;
- pipeline stages: `split_pipeline_stage` (solutions/train/pp_training.py) on the workshop model;
- pipeline schedules: the order in which torch's ScheduleGPipe and Schedule1F1B run each rank's
  forward and backward passes (their own step loop, on a stand-in stage), timed with a forward
  of 1 unit and a backward of 2 units (utils/pipeline_timeline.py's schedule_order and
  simulate, which also draw a run's own schedule).

    python tools/figures.py           # write slides/figures/*.svg
    python tools/figures.py --check   # exit 1 if a committed figure differs from what it writes

No plotting library: the SVG text is written by hand, with fixed rounding, so the output is
byte-for-byte reproducible and a test can compare it with the committed files.

Every figure is drawn at the size a slide shows it: 1120 units wide, the width of a slide's
content (1280 px less marp's padding), shown with `![w:1120](figures/NAME.svg)`, and at most
460 high under a slide's title (less with text below it). So a font-size here is the size in px
on the slide, and none is below 16 (tests/test_slides.py measures it as shown, and that no label
leaves its box or overlaps another one).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import sys
from html import escape
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "slides" / "figures"
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402

from model import TransformerLM, get_config  # noqa: E402
from utils.data import DistributedEvalSampler  # noqa: E402
from utils.pipeline_timeline import (pipeline_bubble_fraction, schedule_order,  # noqa: E402
                                     simulate)

FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"
MONO = "DejaVu Sans Mono, Menlo, Consolas, monospace"
INK, GREY, LIGHT = "#1f2937", "#6b7280", "#e5e7eb"
# one colour per rank (or per microbatch), readable on white and on a projector
RANK_COLOURS = ["#2563eb", "#16a34a", "#ea580c", "#9333ea", "#0891b2", "#ca8a04", "#db2777",
                "#4b5563"]
PALE = ["#dbeafe", "#dcfce7", "#ffedd5", "#f3e8ff", "#cffafe", "#fef9c3", "#fce7f3", "#f3f4f6"]
NODES, GPUS_PER_NODE = 2, 4  # the course's cluster layout: 2 nodes x 4 GPUs
WIDTH = 1120  # a slide's content width in px: a figure shown with ![w:1120] is drawn 1:1
MIN_FONT = 16  # px on the slide: readable from the back of a room


def fmt(v: float) -> str:
    return f"{v:.1f}".rstrip("0").rstrip(".")


class Svg:
    """A few shapes, written as SVG text with fixed rounding."""

    def __init__(self, height: int, title: str, width: int = WIDTH):
        self.width, self.height, self.items = width, height, []
        self.items.append(f"<title>{escape(title)}</title>")

    def rect(self, x, y, w, h, fill="white", stroke=INK, rx=6, width=1.5, dash=None):
        extra = f' stroke-dasharray="{dash}"' if dash else ""
        self.items.append(f'<rect x="{fmt(x)}" y="{fmt(y)}" width="{fmt(w)}" height="{fmt(h)}" '
                          f'rx="{rx}" fill="{fill}" stroke="{stroke}" stroke-width="{width}"{extra}/>')

    def text(self, x, y, s, size=18, anchor="middle", fill=INK, weight="normal", mono=False):
        if size < MIN_FONT:
            raise ValueError(f"figures: {s!r} at font-size {size}: at least {MIN_FONT}")
        self.items.append(f'<text x="{fmt(x)}" y="{fmt(y)}" font-size="{size}" '
                          f'text-anchor="{anchor}" fill="{fill}" font-weight="{weight}" '
                          f'font-family="{MONO if mono else FONT}">{escape(str(s))}</text>')

    def line(self, x1, y1, x2, y2, stroke=INK, width=2, arrow=False, dash=None):
        extra = ' marker-end="url(#arrow)"' if arrow else ""
        extra += f' stroke-dasharray="{dash}"' if dash else ""
        self.items.append(f'<line x1="{fmt(x1)}" y1="{fmt(y1)}" x2="{fmt(x2)}" y2="{fmt(y2)}" '
                          f'stroke="{stroke}" stroke-width="{width}"{extra}/>')

    def arrow(self, x1, y1, x2, y2, stroke=INK, width=2, dash=None):
        self.line(x1, y1, x2, y2, stroke, width, arrow=True, dash=dash)

    def render(self) -> str:
        head = (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {self.width} {self.height}" '
                f'width="{self.width}" height="{self.height}">\n'
                '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
                'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" '
                f'fill="{INK}"/></marker></defs>\n'
                f'<rect width="{self.width}" height="{self.height}" fill="white"/>\n')
        return head + "\n".join(self.items) + "\n</svg>\n"


def load_solution(name: str):
    """Import solutions/train/<name>.py as a module (it is a script, not a package)."""
    path = ROOT / "solutions" / "train" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_figures_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def workshop_model(vocab_size: int = 33278) -> TransformerLM:
    """The workshop preset on the meta device: shapes only, built in milliseconds."""
    with torch.device("meta"):
        return TransformerLM(get_config("workshop", vocab_size=vocab_size))


# ------------------------------------------------------------------------------ ranks
def ranks() -> Svg:
    """World size, rank and local rank on 2 nodes x 4 GPUs, as torchrun numbers them."""
    world = NODES * GPUS_PER_NODE
    s = Svg(425, "ranks on 2 nodes with 4 GPUs each")
    for node in range(NODES):
        x0 = node * 570
        s.rect(x0 + 1, 1, 548, 328, fill="#f9fafb", rx=12)
        s.text(x0 + 20, 38, f"node {node}", 24, anchor="start", weight="bold")
        s.text(x0 + 530, 38, f"GROUP_RANK={node}", 17, anchor="end", fill=GREY, mono=True)
        for local in range(GPUS_PER_NODE):
            rank = node * GPUS_PER_NODE + local  # torchrun: group rank * nproc_per_node + local
            x = x0 + 20 + local * 130
            s.rect(x, 58, 120, 256, fill=PALE[rank], stroke=RANK_COLOURS[rank], width=2.5)
            s.text(x + 60, 90, f"GPU {local}", 20, weight="bold")
            s.text(x + 60, 136, "RANK", 17, fill=GREY, mono=True)
            s.text(x + 60, 174, rank, 36, weight="bold", fill=RANK_COLOURS[rank])
            s.text(x + 60, 216, "LOCAL_RANK", 17, fill=GREY, mono=True)
            s.text(x + 60, 252, local, 28, weight="bold")
            s.text(x + 60, 294, f"cuda:{local}", 17, mono=True)
    s.text(WIDTH / 2, 372, f"WORLD_SIZE = {NODES} nodes x {GPUS_PER_NODE} GPUs = {world} "
           f"processes;  RANK = GROUP_RANK x {GPUS_PER_NODE} + LOCAL_RANK", 21)
    s.text(WIDTH / 2, 410, "torchrun numbers the nodes at the rendezvous; LOCAL_RANK picks the "
           "GPU; rank 0 prints and saves", 18, fill=GREY)
    return s


# ------------------------------------------------------------------------------ rendezvous
def rendezvous() -> Svg:
    """From sbatch to 8 processes in one process group."""
    s = Svg(455, "how the processes of a job find each other")
    mid = WIDTH / 2
    s.rect(mid - 250, 1, 500, 48, fill="#f3f4f6")
    s.text(mid, 32, "sbatch job.sbatch  (batch script on node 0)", 18)
    s.text(mid, 78, 'MASTER_ADDR = first node of $SLURM_JOB_NODELIST (its "i" name on JSC)', 17,
           fill=GREY)
    s.text(mid, 102, "MASTER_PORT = 20000 + SLURM_JOB_ID % 10000", 17, fill=GREY, mono=True)
    top = 140
    for node in range(NODES):
        x0 = 10 + node * 570
        s.arrow(mid, 110, x0 + 265, top - 2)
        s.rect(x0, top, 530, 240, fill="#f9fafb", rx=12)
        s.text(x0 + 20, top + 28, f"node {node}: srun task {node}", 19, anchor="start",
               weight="bold")
        host = "is_host=1: hosts the rendezvous" if node == 0 else "is_host=0: joins it"
        s.rect(x0 + 20, top + 42, 490, 62, fill="white")
        s.text(x0 + 265, top + 66, "torchrun --rdzv_backend=c10d", 17, mono=True)
        s.text(x0 + 265, top + 93, host, 17, fill=GREY)
        for local in range(GPUS_PER_NODE):
            rank = node * GPUS_PER_NODE + local
            x = x0 + 21 + local * 126
            s.arrow(x0 + 265, top + 104, x + 55, top + 138)
            s.rect(x, top + 140, 110, 88, fill=PALE[rank], stroke=RANK_COLOURS[rank], width=2)
            s.text(x + 55, top + 162, "train.py", 16, mono=True)
            s.text(x + 55, top + 190, f"RANK {rank}", 17, weight="bold", fill=RANK_COLOURS[rank])
            s.text(x + 55, top + 216, "setup()", 16, mono=True)
    s.line(10 + 510, top + 73, 580 + 20, top + 73, stroke=RANK_COLOURS[0], width=3, dash="8 6")
    s.text(mid, 412, "node 1's torchrun joins at MASTER_ADDR:MASTER_PORT; when all nodes are "
           "in, each process gets its RANK", 18)
    s.text(mid, 442, "setup() then calls init_process_group: NCCL on GPUs, gloo on CPUs", 18,
           fill=GREY)
    return s


# ------------------------------------------------------------------------------ collectives
def reference_collective(name: str, inputs: list[list[int]]) -> list[list[int]]:
    """What each rank holds after the collective (the semantics of torch.distributed's
    broadcast(src=0), all_reduce(SUM), all_gather and reduce_scatter(SUM))."""
    n = len(inputs)
    if name == "broadcast":
        return [list(inputs[0]) for _ in range(n)]
    if name == "all-reduce":
        total = [sum(col) for col in zip(*inputs, strict=True)]
        return [list(total) for _ in range(n)]
    if name == "all-gather":
        return [[v for x in inputs for v in x] for _ in range(n)]
    if name == "reduce-scatter":
        total = [sum(col) for col in zip(*inputs, strict=True)]
        per = len(total) // n
        return [total[r * per:(r + 1) * per] for r in range(n)]
    raise ValueError(name)


COLLECTIVES = [
    # name, the torch.distributed call, inputs per rank
    ("broadcast", "broadcast(t, src=0)", [[5, 1], [0, 0], [0, 0], [0, 0]]),
    ("all-reduce", "all_reduce(t)", [[1, 2], [3, 4], [5, 6], [7, 8]]),
    ("all-gather", "all_gather_into_tensor", [[1], [2], [3], [4]]),
    ("reduce-scatter", "reduce_scatter_tensor", [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4],
                                                 [1, 2, 3, 4]]),
]


def collectives() -> Svg:
    """Before and after each collective on 4 ranks (where the course uses them: the deck's
    next slide)."""
    s = Svg(455, "collectives on 4 ranks")
    before, after, pitch = 280, 732, 94  # x of each group's first rank; one rank's width
    for x0, when in ((before, "before"), (after, "after")):
        s.text(x0 + 2 * pitch - 5, 20, when, 18, weight="bold", fill=GREY)
        for r in range(len(COLLECTIVES[0][2])):
            s.text(x0 + r * pitch + 42, 48, f"rank {r}", 17, fill=RANK_COLOURS[r],
                   weight="bold")
    for i, (name, call, inputs) in enumerate(COLLECTIVES):
        outputs = reference_collective(name, inputs)
        y0 = 60 + i * 99
        s.rect(1, y0, WIDTH - 2, 92, fill="#f9fafb", stroke=LIGHT, rx=10)
        s.text(16, y0 + 38, name, 22, anchor="start", weight="bold")
        s.text(16, y0 + 68, call, 16, anchor="start", fill=GREY, mono=True)
        for values, x0 in ((inputs, before), (outputs, after)):
            for r, vals in enumerate(values):
                w = 84 / len(vals)
                for c, v in enumerate(vals):
                    x = x0 + r * pitch + c * w
                    s.rect(x, y0 + 20, w - 3, 52, fill=PALE[r], stroke=RANK_COLOURS[r],
                           rx=4, width=1.5)
                    s.text(x + (w - 3) / 2, y0 + 53, v, 20 if len(vals) <= 2 else 17,
                           weight="bold")
        s.arrow(before + 4 * pitch, y0 + 46, after - 12, y0 + 46, width=3)
    return s


# ------------------------------------------------------------------------------ DDP
def ddp() -> Svg:
    world = 4
    s = Svg(446, "DDP: replicas and the gradient all-reduce")
    for r in range(world):
        x, mid = 1 + r * 288, 1 + r * 288 + 127
        s.rect(x, 1, 254, 64, fill=PALE[r], stroke=RANK_COLOURS[r], width=2)
        s.text(mid, 29, f"shard {r} of the batch", 18, weight="bold")
        s.text(mid, 54, "from DistributedSampler", 16, fill=GREY)
        s.arrow(mid, 65, mid, 94)
        s.rect(x, 96, 254, 150, fill="white", stroke=RANK_COLOURS[r], width=2.5)
        s.text(mid, 126, f"rank {r}", 20, weight="bold", fill=RANK_COLOURS[r])
        s.text(mid, 152, "the whole model", 17, fill=RANK_COLOURS[r])
        s.text(mid, 180, "forward, loss", 17)
        s.text(mid, 205, "backward: gradients", 17)
        s.text(mid, 230, "of this shard only", 17, fill=GREY)
        s.arrow(mid, 246, mid, 282)
        s.arrow(mid, 330, mid, 362)
        s.rect(x, 364, 254, 80, fill="#f3f4f6", stroke=RANK_COLOURS[r], width=2)
        s.text(mid, 397, "optimizer.step()", 17, mono=True)
        s.text(mid, 424, "the same update", 17)
    s.rect(1, 284, WIDTH - 2, 46, fill="#fef3c7", stroke="#b45309", width=2)
    s.text(WIDTH / 2, 313, "all-reduce of the gradients, in buckets, during backward(): "
           f"every rank gets the mean of all {world}", 18, weight="bold")
    return s


# ------------------------------------------------------------------------------ FSDP
def fsdp_units() -> list[str]:
    """The FSDP units apply_fsdp makes, in call order: recorded from fully_shard's arguments."""
    fsdp = load_solution("fsdp_training")
    model = workshop_model()
    names = {id(m): n or "root" for n, m in model.named_modules()}
    calls = []
    with mock.patch.object(fsdp, "fully_shard", lambda module, **kw: calls.append(names[id(module)])):
        fsdp.apply_fsdp(model)
    return calls


def fsdp() -> Svg:
    units = fsdp_units()
    world = 4
    s = Svg(445, "FSDP: units, shards, gather before use, reduce-scatter of gradients")
    s.text(0, 20, f"apply_fsdp: {len(units)} fully_shard calls, one FSDP unit each "
           f"(workshop preset: {', '.join(units[:2])}, ..., {units[-2]}, then {units[-1]})",
           17, anchor="start")
    # each rank holds 1/world of every unit
    shown = units[:3] + ["..."] + units[-2:]
    for r in range(world):
        y = 58 + r * 42
        s.text(0, y + 22, f"rank {r}", 18, anchor="start", fill=RANK_COLOURS[r], weight="bold")
        for j, unit in enumerate(shown):
            x = 92 + j * 172
            if unit == "...":
                s.text(x + 76, y + 22, "...", 20)
                continue
            for k in range(world):
                w = 152 / world
                mine = k == r
                s.rect(x + k * w, y, w - 3, 30, fill=PALE[k] if mine else "white",
                       stroke=RANK_COLOURS[k] if mine else LIGHT, rx=3, width=2 if mine else 1)
            if r == 0:
                s.text(x + 76, y - 10, unit.replace("layers.", "block "), 17, fill=GREY)
    s.text(WIDTH / 2, 246, f"each rank keeps 1/{world} of every unit's weights, gradients and "
           "AdamW state (filled: its own shard)", 17, fill=GREY)
    # one unit's life during a step: (what, two lines of detail, fill)
    steps = [("all-gather", "full weights", "of block i", "#fef3c7"),
             ("forward", "then free the", "gathered copy", "white"),
             ("all-gather", "again, for", "backward", "#fef3c7"),
             ("backward", "gradients of", "the full block", "white"),
             ("reduce-scatter", "each rank: the", "sum of its shard", "#fef3c7"),
             ("optimizer.step()", "on its shard", "only", "#f3f4f6")]
    s.text(0, 284, "one unit (block i) in a step, on every rank:", 18, anchor="start",
           weight="bold")
    for j, (what, detail1, detail2, fill) in enumerate(steps):
        x = 1 + j * 190
        s.rect(x, 300, 168, 92, fill=fill)
        s.text(x + 84, 330, what, 17, weight="bold")
        s.text(x + 84, 356, detail1, 16, fill=GREY)
        s.text(x + 84, 378, detail2, 16, fill=GREY)
        if j < len(steps) - 1:
            s.arrow(x + 168, 346, x + 189, 346)
    s.text(WIDTH / 2, 432, "while block i computes, block i+1 is gathered: communication "
           "hides behind compute", 19)
    return s


# ------------------------------------------------------------------------------ TP
def tp_plan() -> tuple[dict[str, str], dict[str, str]]:
    """The styles apply_tp gives each module: (in a block, on the root), by class name."""
    tp = load_solution("tp_training")
    model = workshop_model()
    plans = []
    with mock.patch.object(tp, "parallelize_module",
                           lambda module, mesh, plan: plans.append(plan)):
        tp.apply_tp(model, tp_mesh=None)
    block_plan = {k: type(v).__name__ for k, v in plans[0].items()}
    root_plan = {k: type(v).__name__ for k, v in plans[-1].items()}
    if any(p.keys() != plans[0].keys() for p in plans[:-1]):
        raise SystemExit("figures: apply_tp gives the blocks different plans; draw them apart")
    return block_plan, root_plan


def tp() -> Svg:
    block_plan, root_plan = tp_plan()
    cfg = get_config("workshop")
    degree = 4
    s = Svg(456, "tensor parallelism: the plan of apply_tp in one block")

    def part(y0, title, names, split_note, reduce_note):
        s.text(0, y0 + 20, title, 19, anchor="start", weight="bold")
        col = [n for n in names if block_plan[n] == "ColwiseParallel"]
        row = [n for n in names if block_plan[n] == "RowwiseParallel"]
        short = lambda ns: " ".join(n.split(".")[-1] for n in ns)  # noqa: E731
        s.text(325, y0 + 46, f"{short(col)}: {block_plan[col[0]]}", 16, mono=True,
               weight="bold")
        s.text(650, y0 + 46, f"{short(row)}: {block_plan[row[0]]}", 16, mono=True,
               weight="bold")
        mid = y0 + 56 + (3 * 32 + 28) / 2
        s.rect(1, mid - 50, 110, 100, fill="#f3f4f6")
        s.text(56, mid - 12, "x", 22, weight="bold")
        s.text(56, mid + 14, "(whole, on", 16, fill=GREY)
        s.text(56, mid + 34, "every rank)", 16, fill=GREY)
        for r in range(degree):
            y = y0 + 56 + r * 32
            s.arrow(111, mid, 150, y + 14, width=1.5)
            s.rect(150, y, 350, 28, fill=PALE[r], stroke=RANK_COLOURS[r], rx=4, width=2)
            s.text(325, y + 20, f"rank {r}: {split_note(r)}", 16)
            s.arrow(500, y + 14, 540, y + 14, width=1.5)
            s.rect(540, y, 220, 28, fill=PALE[r], stroke=RANK_COLOURS[r], rx=4, width=2)
            s.text(650, y + 20, "a partial sum", 16)
            s.arrow(760, y + 14, 800, mid + (r - 1.5) * 20, width=1.5)
        s.rect(800, mid - 50, WIDTH - 801, 100, fill="#fef3c7", stroke="#b45309", width=2)
        s.text(960, mid - 16, "all-reduce (sum)", 18, weight="bold")
        s.text(960, mid + 10, reduce_note, 16)
        s.text(960, mid + 34, "whole output on every rank", 16, fill=GREY)

    attn = [n for n in block_plan if n.startswith("attn.")]
    mlp = [n for n in block_plan if n.startswith("mlp.")]
    heads = cfg.n_heads // degree
    part(0, f"attention (workshop preset: {cfg.n_heads} heads, TP {degree})", attn,
         lambda r: f"heads {r * heads}-{r * heads + heads - 1} (q, k, v)", "one per attention")
    hidden = cfg.d_ff // degree
    part(188, f"MLP (d_ff {cfg.d_ff}, TP {degree})", mlp,
         lambda r: f"hidden units {r * hidden}-{r * hidden + hidden - 1}", "one per MLP")
    s.text(WIDTH / 2, 396, "outside the blocks: " + ", ".join(f"{k}: {v}"
                                                              for k, v in root_plan.items()),
           16, mono=True)
    s.text(WIDTH / 2, 422, "the vocabulary is split in the embedding and the logits; "
           "loss_parallel() computes the loss on the pieces", 17, fill=GREY)
    s.text(WIDTH / 2, 448, "backward: one all-reduce per attention and one per MLP as well "
           "(for the gradient of x)", 17, fill=GREY)
    return s


def mesh() -> Svg:
    """The (dp, tp) mesh of the TP step on 2 nodes x 4 GPUs: init_device_mesh's layout."""
    world, degree = NODES * GPUS_PER_NODE, GPUS_PER_NODE
    layout = torch.arange(world).reshape(world // degree, degree)  # what init_device_mesh uses
    s = Svg(296, "the 2-D mesh (dp, tp)")
    for dp in range(layout.shape[0]):
        y = 1 + dp * 130
        s.rect(1, y, 840, 110, fill="#f9fafb", rx=12)
        s.text(18, y + 48, f"node {dp}", 20, anchor="start", weight="bold")
        s.text(18, y + 76, f"dp index {dp}", 17, anchor="start", fill=GREY)
        for tp_idx in range(degree):
            rank = int(layout[dp, tp_idx])
            x = 160 + tp_idx * 170
            s.rect(x, y + 29, 156, 52, fill=PALE[tp_idx], stroke=RANK_COLOURS[tp_idx], width=2)
            s.text(x + 78, y + 61, f"rank {rank}: tp {tp_idx}", 17)
    for tp_idx in range(degree):
        x = 160 + tp_idx * 170 + 78
        s.line(x, 1 + 81, x, 131 + 29, stroke="#b45309", width=3, dash="6 5")
    s.text(985, 36, "a row: one TP group", 18, weight="bold")
    s.text(985, 62, "shares every layer,", 17, fill=GREY)
    s.text(985, 86, "computes on one batch", 17, fill=GREY)
    s.text(985, 150, "a column: a dp group", 18, weight="bold", fill="#b45309")
    s.text(985, 176, "the same TP slice,", 17, fill=GREY)
    s.text(985, 200, "FSDP-sharded,", 17, fill=GREY)
    s.text(985, 224, "different batches", 17, fill=GREY)
    s.text(WIDTH / 2, 284, 'init_device_mesh(device.type, (world_size // tp, tp), '
           'mesh_dim_names=("dp", "tp"))', 17, mono=True)
    return s


# ------------------------------------------------------------------------------ PP
def pp_stages() -> Svg:
    pp = load_solution("pp_training")
    stages = 4
    s = Svg(130, "pipeline stages made by split_pipeline_stage")
    for i in range(stages):
        model = pp.split_pipeline_stage(workshop_model(), i, stages)
        parts = []
        if model.tok_emb is not None:
            parts.append("tok_emb, pos_emb")
        parts.append("blocks " + ", ".join(model.layers))
        if model.output is not None:
            parts.append("norm, output")
        x = 2 + i * 290
        s.rect(x, 2, 246, 126, fill=PALE[i], stroke=RANK_COLOURS[i], width=2.5)
        s.text(x + 123, 34, f"stage {i} = rank {i}", 20, weight="bold", fill=RANK_COLOURS[i])
        for j, p in enumerate(parts):
            s.text(x + 123, 72 + j * 30, p, 17, mono=True)
        if i < stages - 1:
            s.arrow(x + 248, 50, x + 288, 50, width=3)
            s.arrow(x + 288, 92, x + 248, 92, stroke=GREY, width=3)
    return s


def pp_schedule() -> Svg:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    stages, microbatches = 4, 8
    s = Svg(452, f"GPipe and 1F1B, {stages} stages x {microbatches} microbatches")
    totals, idles = [], []
    for k, (name, cls) in enumerate((("GPipe (ScheduleGPipe)", ScheduleGPipe),
                                     ("1F1B (Schedule1F1B)", Schedule1F1B))):
        timeline = simulate(schedule_order(cls, stages, microbatches))
        total = max(end for rank in timeline for *_, end in rank)
        busy = sum(end - start for rank in timeline for *_, start, end in rank)
        idle = 1 - busy / (total * stages)
        totals.append(total)
        idles.append(idle)
        unit = (WIDTH - 80) / total
        # activations alive at once on stage 0: forwards started minus backwards finished
        alive, peak = 0, 0
        for _, kind, *_ in timeline[0]:
            alive += 1 if kind == "F" else -1
            peak = max(peak, alive)
        y0 = k * 200
        s.text(0, y0 + 20, name, 19, anchor="start", weight="bold")
        s.text(WIDTH, y0 + 20, f"idle {idle:.0%} of every stage's step; stage 0 holds up to "
               f"{peak} microbatches' activations", 17, anchor="end", fill=GREY)
        for r, actions in enumerate(timeline):
            y = y0 + 32 + r * 40
            s.text(0, y + 23, f"stage {r}", 17, anchor="start")
            s.rect(80, y, total * unit, 34, fill="#f9fafb", stroke=LIGHT, rx=2, width=1)
            for _, kind, mb, start, end in actions:
                x = 80 + start * unit
                fill = PALE[mb] if kind == "F" else RANK_COLOURS[mb]
                s.rect(x, y, (end - start) * unit, 34, fill=fill, stroke=RANK_COLOURS[mb],
                       rx=3, width=1.5)
                s.text(x + (end - start) * unit / 2, y + 23, f"{kind}{mb}", 16,
                       fill=INK if kind == "F" else "white", weight="bold")
    steps = (f"a step takes {fmt(totals[0])} units in both" if totals[0] == totals[1] else
             f"a step takes {fmt(totals[0])} and {fmt(totals[1])} units")
    s.text(WIDTH / 2, 414, f"time: forward 1 unit, backward 2 units; {steps}", 17, fill=GREY)
    theory = pipeline_bubble_fraction(stages, microbatches)
    measured = ("as drawn for both" if all(f"{i:.0%}" == f"{theory:.0%}" for i in idles)
                else "in theory")
    s.text(WIDTH / 2, 442, f"bubble (p-1)/(m+p-1) = {stages - 1}/{microbatches + stages - 1} = "
           f"{theory:.0%}, {measured}; 1F1B starts backwards early and frees activations sooner",
           18)
    return s


# ------------------------------------------------------------------------------ data
def sampler() -> Svg:
    """Which sample each rank reads: the real samplers, called here."""
    n_train, n_eval, world = 10, 10, 4
    s = Svg(388, f"DistributedSampler and DistributedEvalSampler, {n_train} samples on "
            f"{world} ranks")
    dataset = list(range(n_train))
    s.text(0, 22, "DistributedSampler(..., shuffle=True, seed=0, drop_last=True)", 20,
           anchor="start", mono=True, weight="bold")
    x_rank = [190 + r * 232 for r in range(world)]
    for r, x in enumerate(x_rank):  # one heading per column: the rows below line up with it
        s.text(x, 54, f"rank {r}", 18, anchor="start", fill=RANK_COLOURS[r], weight="bold")

    def cells(x, y, idx, r, pad_from=None):
        for j, i in enumerate(idx):
            pad = pad_from is not None and i >= pad_from
            s.rect(x + j * 64, y, 56, 46, fill="white" if pad else PALE[r],
                   stroke=GREY if pad else RANK_COLOURS[r], rx=5, width=2.5,
                   dash="6 4" if pad else None)
            s.text(x + j * 64 + 28, y + 31, "pad" if pad else i, 17 if pad else 22,
                   weight="bold", fill=GREY if pad else INK)

    for e, epoch in enumerate((0, 1)):
        y0 = 64 + e * 84
        s.text(0, y0 + 29, f"set_epoch({epoch})", 18, anchor="start", mono=True)
        for r in range(world):
            sampler = DistributedSampler(dataset, num_replicas=world, rank=r, shuffle=True,
                                         seed=0, drop_last=True)
            sampler.set_epoch(epoch)
            cells(x_rank[r], y0, list(sampler), r)
        used = {i for r in range(world) for i in DistributedSampler(
            dataset, num_replicas=world, rank=r, shuffle=True, seed=0, drop_last=True)}
        dropped = ", ".join(str(i) for i in sorted(set(dataset) - used))
        s.text(x_rank[0], y0 + 70, f"disjoint, equal shards; left out this epoch: {dropped}"
               if epoch == 0 else "a new order every epoch, the same on every rank", 18,
               anchor="start", fill=GREY)
    s.text(0, 258, f"DistributedEvalSampler(ds, num_replicas={world}, rank=r)", 20,
           anchor="start", mono=True, weight="bold")
    ds = list(range(n_eval))
    for r in range(world):
        cells(x_rank[r], 272, list(DistributedEvalSampler(ds, num_replicas=world, rank=r)), r,
              pad_from=n_eval)
    s.text(0, 301, "evaluation", 18, anchor="start")
    s.text(WIDTH / 2, 350, "every sample exactly once; a padding sample's targets are ignored: "
           "it counts nowhere", 18, fill=GREY)
    s.text(WIDTH / 2, 378, "and every rank runs the same number of batches", 18, fill=GREY)
    return s


def storage() -> Svg:
    s = Svg(440, "where the course's data lives on a cluster")
    s.rect(1, 10, 310, 170, fill="#f3f4f6")
    s.text(156, 46, "login node (internet)", 20, weight="bold")
    s.text(156, 86, "python prepare_data.py", 17, mono=True)
    s.text(156, 120, "downloads WikiText-2 once,", 17, fill=GREY)
    s.text(156, 146, "tokenises it into one file", 17, fill=GREY)
    s.arrow(311, 95, 378, 95)
    s.rect(380, 1, 360, 438, fill="#fef9c3", stroke="#ca8a04", width=2)
    s.text(560, 36, "project / scratch file system", 19, weight="bold")
    s.text(560, 62, "(parallel, seen by every node)", 17, fill=GREY)
    for j, (name, note) in enumerate((("data_cache/", "$COURSE_DATA_CACHE: one .pt file"),
                                      ("runs/<job>-<id>/", "OUT_DIR: logs, summary.json"),
                                      ("  checkpoints/last/", "DCP: one file per rank"),
                                      (".venv/", "VENV: the Python environment"))):
        y = 84 + j * 88
        s.rect(398, y, 324, 72, fill="white", stroke="#ca8a04")
        s.text(412, y + 28, name, 17, anchor="start", mono=True, weight="bold")
        s.text(412, y + 56, note, 16, anchor="start", fill=GREY)
    for n in range(NODES):
        y = 10 + n * 232
        s.rect(810, y, 309, 188, fill="#f9fafb")
        s.text(964, y + 34, f"compute node {n}", 20, weight="bold")
        s.text(964, y + 58, "(no internet)", 17, fill=GREY)
        s.text(964, y + 90, "HF_HUB_OFFLINE=1", 17, mono=True)
        s.text(964, y + 120, "reads the cache in < 1 s,", 16, fill=GREY)
        s.text(964, y + 144, "windows are slices of a tensor", 16, fill=GREY)
        s.text(964, y + 168, "in memory: no file per sample", 16, fill=GREY)
        s.arrow(740, 190 + n * 60, 808, y + 94)
    s.rect(1, 230, 310, 190, fill="white", stroke="#dc2626", width=2, dash="7 5")
    s.text(156, 272, "$HOME", 20, weight="bold", fill="#dc2626")
    s.text(156, 314, "small quota, often slow or", 17, fill=GREY)
    s.text(156, 342, "backed up: not for data,", 17, fill=GREY)
    s.text(156, 370, "caches or checkpoints", 17, fill=GREY)
    return s


def memory() -> Svg:
    """Bytes per GPU of the workshop model on 2 nodes x 4 GPUs for each layout of the memory
    step: utils/memory.py's formula (what every script prints next to its measurement)."""
    from utils.memory import Layout, predict
    cfg = workshop_model().cfg
    gpus, batch = NODES * GPUS_PER_NODE, 32
    rows = [("DDP", Layout(dp=gpus)), ("ZeRO-1", Layout(dp=gpus, zero=1)),
            ("ZeRO-2", Layout(dp=gpus, zero=2)),
            ("ZeRO-3 (FSDP)", Layout(dp=gpus, zero=3)),
            ("+ activation ckpt", Layout(dp=gpus, zero=3, checkpointing=True)),
            ("+ CPU offload", Layout(dp=gpus, zero=3, offload=True, checkpointing=True))]
    parts = [("parameters", "parameters"), ("gradients", "gradients"),
             ("optimizer", "AdamW state"), ("activations", "activations"),
             ("gathered", "gathered weights")]
    numbers = [(name, layout, predict(cfg, batch * cfg.max_seq_len, layout, precision="bf16"))
               for name, layout in rows]
    on_gpu = [sum(v[k] for k, _ in parts) - (sum(v[k] for k in ("parameters", "gradients",
                                                                  "optimizer"))
                                               if layout.offload else 0)
              for _, layout, v in numbers]
    top, row_h, left, right = 56, 52, 200, 130
    scale = (WIDTH - left - right) / max(on_gpu)
    svg = Svg(top + row_h * len(rows) + 10,
              f"Bytes per GPU, workshop model, {gpus} GPUs, batch {batch}, bf16")
    x = 10
    for i, (_, label) in enumerate(parts):  # the legend
        svg.rect(x, 12, 22, 22, fill=RANK_COLOURS[i], stroke=RANK_COLOURS[i], rx=3)
        svg.text(x + 30, 30, label, size=18, anchor="start")
        x += 40 + 11 * len(label)
    for r, ((name, layout, v), total) in enumerate(zip(numbers, on_gpu, strict=True)):
        y = top + r * row_h
        svg.text(left - 12, y + 30, name, size=18, anchor="end")
        x = left
        for i, (key, _) in enumerate(parts):
            if layout.offload and key in ("parameters", "gradients", "optimizer"):
                continue  # in host memory
            w = v[key] * scale
            if w > 0.5:
                svg.rect(x, y + 8, w, 34, fill=RANK_COLOURS[i], stroke="white", rx=2, width=1)
            x += w
        svg.text(x + 10, y + 31, f"{total / 2**30:.2f} GiB", size=18, anchor="start")
    return svg


FIGURES = {
    "ranks": ranks, "rendezvous": rendezvous, "collectives": collectives, "ddp": ddp,
    "fsdp": fsdp, "tp": tp, "mesh": mesh, "pp-stages": pp_stages, "pp-schedule": pp_schedule,
    "sampler": sampler, "storage": storage, "memory": memory,
}


def render_all() -> dict[str, str]:
    with contextlib.redirect_stdout(sys.stderr):  # imported scripts must not print into output
        return {f"{name}.svg": make().render() for name, make in FIGURES.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="compare with the committed files instead of writing them")
    args = parser.parse_args(argv)
    figures = render_all()
    if args.check:
        stale = [name for name, svg in figures.items()
                 if not (OUT_DIR / name).is_file() or (OUT_DIR / name).read_text() != svg]
        extra = sorted(p.name for p in OUT_DIR.glob("*.svg") if p.name not in figures)
        for name in stale:
            print(f"slides/figures/{name} differs from what tools/figures.py draws now: "
                  "run python tools/figures.py", file=sys.stderr)
        for name in extra:
            print(f"slides/figures/{name} is not drawn by tools/figures.py: delete it",
                  file=sys.stderr)
        return 1 if stale or extra else 0
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for name, svg in figures.items():
        (OUT_DIR / name).write_text(svg)
    print(f"wrote {len(figures)} figures to {OUT_DIR.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
