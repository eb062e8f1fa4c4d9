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
  of 1 unit and a backward of 2 units.

    python tools/figures.py           # write slides/figures/*.svg
    python tools/figures.py --check   # exit 1 if a committed figure differs from what it writes

No plotting library: the SVG text is written by hand, with fixed rounding, so the output is
byte-for-byte reproducible and a test can compare it with the committed files.
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
from utils.metrics import pipeline_bubble_fraction  # noqa: E402

FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"
MONO = "DejaVu Sans Mono, Menlo, Consolas, monospace"
INK, GREY, LIGHT = "#1f2937", "#6b7280", "#e5e7eb"
# one colour per rank (or per microbatch), readable on white and on a projector
RANK_COLOURS = ["#2563eb", "#16a34a", "#ea580c", "#9333ea", "#0891b2", "#ca8a04", "#db2777",
                "#4b5563"]
PALE = ["#dbeafe", "#dcfce7", "#ffedd5", "#f3e8ff", "#cffafe", "#fef9c3", "#fce7f3", "#f3f4f6"]
NODES, GPUS_PER_NODE = 2, 4  # the course's cluster layout: 2 nodes x 4 GPUs


def fmt(v: float) -> str:
    return f"{v:.1f}".rstrip("0").rstrip(".")


class Svg:
    """A few shapes, written as SVG text with fixed rounding."""

    def __init__(self, width: int, height: int, title: str):
        self.width, self.height, self.items = width, height, []
        self.items.append(f"<title>{escape(title)}</title>")

    def rect(self, x, y, w, h, fill="white", stroke=INK, rx=6, width=1.5, dash=None):
        extra = f' stroke-dasharray="{dash}"' if dash else ""
        self.items.append(f'<rect x="{fmt(x)}" y="{fmt(y)}" width="{fmt(w)}" height="{fmt(h)}" '
                          f'rx="{rx}" fill="{fill}" stroke="{stroke}" stroke-width="{width}"{extra}/>')

    def text(self, x, y, s, size=18, anchor="middle", fill=INK, weight="normal", mono=False):
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
    s = Svg(1200, 430, "ranks on 2 nodes with 4 GPUs each")
    for node in range(NODES):
        x0 = 30 + node * 585
        s.rect(x0, 20, 555, 320, fill="#f9fafb", rx=12)
        s.text(x0 + 20, 55, f"node {node}", 24, anchor="start", weight="bold")
        s.text(x0 + 535, 55, f"GROUP_RANK={node}", 16, anchor="end", fill=GREY, mono=True)
        for local in range(GPUS_PER_NODE):
            rank = node * GPUS_PER_NODE + local  # torchrun: group rank * nproc_per_node + local
            x = x0 + 20 + local * 132
            s.rect(x, 80, 118, 240, fill=PALE[rank], stroke=RANK_COLOURS[rank], width=2.5)
            s.text(x + 59, 115, f"GPU {local}", 20, weight="bold")
            s.text(x + 59, 165, "RANK", 15, fill=GREY, mono=True)
            s.text(x + 59, 200, rank, 34, weight="bold", fill=RANK_COLOURS[rank])
            s.text(x + 59, 240, "LOCAL_RANK", 15, fill=GREY, mono=True)
            s.text(x + 59, 272, local, 26, weight="bold")
            s.text(x + 59, 305, f"cuda:{local}", 15, mono=True)
    s.text(600, 380, f"WORLD_SIZE = {NODES} nodes x {GPUS_PER_NODE} GPUs = {world} processes;  "
           "RANK = GROUP_RANK x 4 + LOCAL_RANK", 22)
    s.text(600, 415, "torchrun numbers the nodes at the rendezvous; LOCAL_RANK picks the GPU; "
           "rank 0 prints and saves", 19, fill=GREY)
    return s


# ------------------------------------------------------------------------------ rendezvous
def rendezvous() -> Svg:
    """From sbatch to 8 processes in one process group."""
    s = Svg(1200, 560, "how the processes of a job find each other")
    s.rect(370, 15, 460, 60, fill="#f3f4f6")
    s.text(600, 52, "sbatch job.sbatch  (batch script on node 0)", 19, mono=False)
    s.text(600, 110, 'MASTER_ADDR = first node of $SLURM_JOB_NODELIST (its "i" name on JSC)', 18,
           fill=GREY)
    s.text(600, 135, "MASTER_PORT = 20000 + SLURM_JOB_ID % 10000", 18, fill=GREY, mono=True)
    for node in range(NODES):
        x0 = 60 + node * 560
        s.arrow(600, 145, x0 + 240, 185)
        s.rect(x0, 190, 480, 300, fill="#f9fafb", rx=12)
        s.text(x0 + 20, 222, f"node {node}: srun task {node}", 20, anchor="start", weight="bold")
        host = "is_host=1: hosts the rendezvous" if node == 0 else "is_host=0: joins it"
        s.rect(x0 + 20, 240, 440, 70, fill="white")
        s.text(x0 + 240, 268, "torchrun --rdzv_backend=c10d", 17, mono=True)
        s.text(x0 + 240, 295, host, 17, fill=GREY)
        for local in range(GPUS_PER_NODE):
            rank = node * GPUS_PER_NODE + local
            x = x0 + 20 + local * 112
            s.arrow(x0 + 240, 310, x + 50, 370)
            s.rect(x, 375, 100, 95, fill=PALE[rank], stroke=RANK_COLOURS[rank], width=2)
            s.text(x + 50, 405, "train.py", 15, mono=True)
            s.text(x + 50, 432, f"RANK {rank}", 16, weight="bold", fill=RANK_COLOURS[rank])
            s.text(x + 50, 456, "setup()", 15, mono=True)
    s.line(60 + 240 + 240, 275, 620 + 20, 275, stroke=RANK_COLOURS[0], width=3, dash="8 6")
    s.text(600, 520, "node 1's torchrun joins at MASTER_ADDR:MASTER_PORT; when all nodes are "
           "in, each process gets its RANK", 18)
    s.text(600, 548, "setup() then calls init_process_group: NCCL on GPUs, gloo on CPUs", 18,
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
    # name, inputs per rank, where the course uses it
    ("broadcast", [[5, 1], [0, 0], [0, 0], [0, 0]], "DDP start: rank 0's weights to all; "
     "PP: the loss from the last stage"),
    ("all-reduce", [[1, 2], [3, 4], [5, 6], [7, 8]], "DDP gradients; losses and token counts "
     "(all_reduce_sum); TP row-wise outputs"),
    ("all-gather", [[1], [2], [3], [4]], "FSDP: a block's full weights before its forward "
     "and backward"),
    ("reduce-scatter", [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]],
     "FSDP: each rank keeps the summed gradient of its shard"),
]


def collectives() -> Svg:
    s = Svg(1200, 640, "collectives on 4 ranks")
    for i, (name, inputs, use) in enumerate(COLLECTIVES):
        outputs = reference_collective(name, inputs)
        y0 = 10 + i * 157
        s.rect(10, y0, 1180, 145, fill="#f9fafb", stroke=LIGHT, rx=10)
        s.text(30, y0 + 32, name, 24, anchor="start", weight="bold")
        s.text(30, y0 + 132, use, 16, anchor="start", fill=GREY)
        for values, x0 in ((inputs, 250), (outputs, 740)):
            for r, vals in enumerate(values):
                x = x0 + r * 105
                cells = len(vals)
                w = 90 / max(cells, 1)
                s.text(x + 45, y0 + 28, f"rank {r}", 14, fill=RANK_COLOURS[r])
                for c, v in enumerate(vals):
                    s.rect(x + c * w, y0 + 40, w - 3, 50, fill=PALE[r], stroke=RANK_COLOURS[r],
                           rx=4, width=1.5)
                    s.text(x + c * w + (w - 3) / 2, y0 + 72, v, 18 if cells <= 2 else 15,
                           weight="bold")
        s.arrow(670, y0 + 65, 725, y0 + 65, width=3)
        s.text(500 + 170, y0 + 112, "before", 14, fill=GREY, anchor="end")
        s.text(740, y0 + 112, "after", 14, fill=GREY, anchor="start")
    return s


# ------------------------------------------------------------------------------ DDP
def ddp() -> Svg:
    world = 4
    s = Svg(1200, 470, "DDP: replicas and the gradient all-reduce")
    for r in range(world):
        x = 30 + r * 292
        s.rect(x, 10, 262, 70, fill=PALE[r], stroke=RANK_COLOURS[r], width=2)
        s.text(x + 131, 40, f"shard {r} of the batch", 18, weight="bold")
        s.text(x + 131, 66, "from DistributedSampler", 15, fill=GREY)
        s.arrow(x + 131, 80, x + 131, 110)
        s.rect(x, 112, 262, 150, fill="white", stroke=RANK_COLOURS[r], width=2.5)
        s.text(x + 131, 142, f"rank {r}: the whole model", 18, weight="bold",
               fill=RANK_COLOURS[r])
        s.text(x + 131, 172, "forward, loss", 16)
        s.text(x + 131, 200, "backward: gradients", 16)
        s.text(x + 131, 228, "of this shard only", 16, fill=GREY)
        s.arrow(x + 131, 262, x + 131, 300)
        s.arrow(x + 131, 350, x + 131, 385)
        s.rect(x, 388, 262, 60, fill="#f3f4f6", stroke=RANK_COLOURS[r], width=2)
        s.text(x + 131, 424, "optimizer.step(): same update", 16)
    s.rect(30, 302, 1140, 46, fill="#fef3c7", stroke="#b45309", width=2)
    s.text(600, 332, "all-reduce of the gradients, in buckets, during backward(): "
           "every rank gets the mean of all 4", 18, weight="bold")
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
    s = Svg(1200, 520, "FSDP: units, shards, gather before use, reduce-scatter of gradients")
    s.text(20, 35, f"apply_fsdp: {len(units)} fully_shard calls, one FSDP unit each "
           f"(workshop preset: {', '.join(units[:2])}, ..., {units[-2]}, then {units[-1]})",
           18, anchor="start")
    # each rank holds 1/world of every unit
    shown = units[:3] + ["..."] + units[-2:]
    for r in range(world):
        y = 60 + r * 52
        s.text(20, y + 32, f"rank {r}", 18, anchor="start", fill=RANK_COLOURS[r], weight="bold")
        for j, unit in enumerate(shown):
            x = 110 + j * 180
            if unit == "...":
                s.text(x + 80, y + 32, "...", 20)
                continue
            for k in range(world):
                w = 160 / world
                mine = k == r
                s.rect(x + k * w, y + 8, w - 2, 34, fill=PALE[k] if mine else "white",
                       stroke=RANK_COLOURS[k] if mine else LIGHT, rx=3, width=2 if mine else 1)
            if r == 0:
                s.text(x + 80, y, unit.replace("layers.", "block "), 17, fill=GREY)
    s.text(600, 290, "each rank keeps 1/4 of every unit's weights, gradients and AdamW state "
           "(filled: its own shard)", 17, fill=GREY)
    # one unit's life during a step
    steps = [("all-gather", "full weights of block i", "#fef3c7"),
             ("forward", "then free the gathered copy", "white"),
             ("all-gather", "again, for backward", "#fef3c7"),
             ("backward", "gradients of the full block", "white"),
             ("reduce-scatter", "each rank: the sum for its shard", "#fef3c7"),
             ("optimizer.step()", "on its shard only", "#f3f4f6")]
    y = 320
    s.text(20, y + 20, "one unit (block i) in a step, on every rank:", 18, anchor="start",
           weight="bold")
    for j, (what, detail, fill) in enumerate(steps):
        x = 20 + j * 197
        s.rect(x, y + 40, 180, 90, fill=fill)
        s.text(x + 90, y + 75, what, 18, weight="bold")
        s.text(x + 90, y + 103, detail.split(" ", 2)[0] + " " + detail.split(" ", 2)[1]
               if len(detail) > 22 else detail, 16, fill=GREY)
        if len(detail) > 22:
            s.text(x + 90, y + 123, detail.split(" ", 2)[2], 16, fill=GREY)
        if j < len(steps) - 1:
            s.arrow(x + 180, y + 85, x + 196, y + 85)
    s.text(600, 500, "while block i computes, block i+1 is gathered: communication hides "
           "behind compute", 20)
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
    s = Svg(1200, 640, "tensor parallelism: the plan of apply_tp in one block")

    def part(y0, title, names, split_note, reduce_note):
        s.text(20, y0 + 25, title, 22, anchor="start", weight="bold")
        col = [n for n in names if block_plan[n] == "ColwiseParallel"]
        row = [n for n in names if block_plan[n] == "RowwiseParallel"]
        short = lambda ns: " ".join(n.split(".")[-1] for n in ns)  # noqa: E731
        s.text(365, y0 + 60, f"{short(col)}: {block_plan[col[0]]}", 15, mono=True,
               weight="bold")
        s.text(705, y0 + 60, f"{short(row)}: {block_plan[row[0]]}", 15, mono=True,
               weight="bold")
        mid = y0 + 72 + 2 * 40 - 3
        s.rect(20, mid - 60, 130, 120, fill="#f3f4f6")
        s.text(85, mid - 5, "x", 22, weight="bold")
        s.text(85, mid + 20, "(whole, on", 14, fill=GREY)
        s.text(85, mid + 38, "every rank)", 14, fill=GREY)
        for r in range(degree):
            y = y0 + 72 + r * 40
            s.arrow(150, mid, 200, y + 17, width=1.5)
            s.rect(200, y, 330, 34, fill=PALE[r], stroke=RANK_COLOURS[r], rx=4, width=2)
            s.text(365, y + 23, f"rank {r}: {split_note(r)}", 15)
            s.arrow(530, y + 17, 580, y + 17, width=1.5)
            s.rect(580, y, 250, 34, fill=PALE[r], stroke=RANK_COLOURS[r], rx=4, width=2)
            s.text(705, y + 23, "a partial sum", 15)
            s.arrow(830, y + 17, 880, mid, width=1.5)
        s.rect(880, mid - 60, 300, 120, fill="#fef3c7", stroke="#b45309", width=2)
        s.text(1030, mid - 20, "all-reduce (sum)", 18, weight="bold")
        s.text(1030, mid + 8, reduce_note, 15)
        s.text(1030, mid + 32, "whole output on every rank", 14, fill=GREY)

    attn = [n for n in block_plan if n.startswith("attn.")]
    mlp = [n for n in block_plan if n.startswith("mlp.")]
    heads = cfg.n_heads // degree
    part(0, f"attention (workshop preset: {cfg.n_heads} heads, TP {degree})", attn,
         lambda r: f"heads {r * heads}-{r * heads + heads - 1} (q, k, v)", "one per attention")
    hidden = cfg.d_ff // degree
    part(255, f"MLP (d_ff {cfg.d_ff}, TP {degree})", mlp,
         lambda r: f"hidden units {r * hidden}-{r * hidden + hidden - 1}", "one per MLP")
    s.text(600, 555, "outside the blocks: " + ", ".join(f"{k}: {v}" for k, v in root_plan.items()),
           16, mono=True)
    s.text(600, 590, "the vocabulary is split in the embedding and the logits; loss_parallel() "
           "computes the loss on the pieces", 17, fill=GREY)
    s.text(600, 622, "backward: one all-reduce per attention and one per MLP as well "
           "(for the gradient of x)", 17, fill=GREY)
    return s


def mesh() -> Svg:
    """The (dp, tp) mesh of the TP step on 2 nodes x 4 GPUs: init_device_mesh's layout."""
    world, degree = NODES * GPUS_PER_NODE, GPUS_PER_NODE
    layout = torch.arange(world).reshape(world // degree, degree)  # what init_device_mesh uses
    s = Svg(1200, 330, "the 2-D mesh (dp, tp)")
    for dp in range(layout.shape[0]):
        y = 20 + dp * 130
        s.rect(20, y, 910, 110, fill="#f9fafb", rx=12)
        s.text(40, y + 48, f"node {dp}", 20, anchor="start", weight="bold")
        s.text(40, y + 76, f"dp index {dp}", 16, anchor="start", fill=GREY)
        for tp_idx in range(degree):
            rank = int(layout[dp, tp_idx])
            x = 190 + tp_idx * 182
            s.rect(x, y + 29, 170, 52, fill=PALE[tp_idx], stroke=RANK_COLOURS[tp_idx], width=2)
            s.text(x + 85, y + 61, f"rank {rank}: tp {tp_idx}", 17)
    for tp_idx in range(degree):
        x = 190 + tp_idx * 182 + 85
        s.line(x, 20 + 81, x, 150 + 29, stroke="#b45309", width=3, dash="6 5")
    s.text(1065, 60, "a row: one TP group", 18, weight="bold")
    s.text(1065, 88, "shares every layer,", 16, fill=GREY)
    s.text(1065, 110, "computes on one batch", 16, fill=GREY)
    s.text(1065, 170, "a column: a dp group", 18, weight="bold", fill="#b45309")
    s.text(1065, 198, "the same TP slice, FSDP-", 16, fill=GREY)
    s.text(1065, 220, "sharded; different batches", 16, fill=GREY)
    s.text(600, 300, 'init_device_mesh(device.type, (world_size // tp, tp), '
           'mesh_dim_names=("dp", "tp"))', 18, mono=True)
    return s


# ------------------------------------------------------------------------------ PP
def pp_stages() -> Svg:
    pp = load_solution("pp_training")
    stages = 4
    s = Svg(1200, 200, "pipeline stages made by split_pipeline_stage")
    for i in range(stages):
        model = pp.split_pipeline_stage(workshop_model(), i, stages)
        parts = []
        if model.tok_emb is not None:
            parts.append("tok_emb, pos_emb")
        parts.append("blocks " + ", ".join(model.layers))
        if model.output is not None:
            parts.append("norm, output")
        x = 10 + i * 300
        s.rect(x, 10, 260, 180, fill=PALE[i], stroke=RANK_COLOURS[i], width=2.5)
        s.text(x + 130, 50, f"stage {i} = rank {i}", 23, weight="bold", fill=RANK_COLOURS[i])
        for j, p in enumerate(parts):
            s.text(x + 130, 95 + j * 36, p, 20, mono=True)
        if i < stages - 1:
            s.arrow(x + 262, 80, x + 298, 80, width=3)
            s.arrow(x + 298, 130, x + 262, 130, stroke=GREY, width=3)
    return s


def schedule_order(cls, stages: int, microbatches: int) -> list[list[tuple[str, int]]]:
    """Each rank's computations in the order torch's schedule runs them: ("F"|"B", microbatch).

    Runs the schedule's own step loop (what schedule.step() calls after splitting the batch)
    on a stand-in stage that records forward_one_chunk and backward_one_chunk and sends nothing.
    """
    order = []
    for rank in range(stages):
        stage = mock.MagicMock()
        stage.num_stages, stage.stage_index, stage.device = stages, rank, "cpu"
        stage.is_first, stage.is_last = rank == 0, rank == stages - 1
        for name in ("get_fwd_recv_ops", "get_fwd_send_ops", "get_bwd_recv_ops",
                     "get_bwd_send_ops"):
            getattr(stage, name).return_value = []
        calls = []
        stage.forward_one_chunk.side_effect = lambda i, *a, calls=calls, **k: calls.append(("F", i))
        stage.backward_one_chunk.side_effect = lambda i, *a, calls=calls, **k: calls.append(("B", i))
        schedule = cls(stage, n_microbatches=microbatches, loss_fn=lambda *a: mock.MagicMock())
        targets = [None] * microbatches if stage.is_last else None
        schedule._step_microbatches([()] * microbatches, [{}] * microbatches, targets, None)
        order.append(calls)
    return order


def simulate(order, forward=1, backward=2):
    """Start and end of every action when each rank runs its actions in order, as soon as the
    input (forward: the previous stage's forward; backward: the next stage's backward, or the
    stage's own forward on the last stage) is ready. Communication is free."""
    stages = len(order)
    done, timeline, pos = {}, [[] for _ in order], [0] * stages
    free = [0] * stages
    while any(pos[r] < len(order[r]) for r in range(stages)):
        progressed = False
        for r in range(stages):
            if pos[r] == len(order[r]):
                continue
            kind, mb = order[r][pos[r]]
            dep = ((r - 1, "F", mb) if kind == "F" and r > 0 else
                   (r + 1, "B", mb) if kind == "B" and r < stages - 1 else
                   (r, "F", mb) if kind == "B" else None)
            if dep is not None and dep not in done:
                continue
            start = max(free[r], done[dep] if dep else 0)
            end = start + (forward if kind == "F" else backward)
            done[(r, kind, mb)], free[r] = end, end
            timeline[r].append((kind, mb, start, end))
            pos[r] += 1
            progressed = True
        if not progressed:
            raise RuntimeError("the schedule's order deadlocks")
    return timeline


def pp_schedule() -> Svg:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    stages, microbatches = 4, 8
    unit = 32
    s = Svg(1200, 560, "GPipe and 1F1B, 4 stages x 8 microbatches")
    for k, (name, cls) in enumerate((("GPipe (ScheduleGPipe)", ScheduleGPipe),
                                     ("1F1B (Schedule1F1B)", Schedule1F1B))):
        timeline = simulate(schedule_order(cls, stages, microbatches))
        total = max(end for rank in timeline for *_, end in rank)
        busy = sum(end - start for rank in timeline for *_, start, end in rank)
        idle = 1 - busy / (total * stages)
        # activations alive at once on stage 0: forwards started minus backwards finished
        alive, peak = 0, 0
        for kind, *_ in timeline[0]:
            alive += 1 if kind == "F" else -1
            peak = max(peak, alive)
        y0 = 20 + k * 255
        s.text(20, y0 + 20, name, 21, anchor="start", weight="bold")
        s.text(1180, y0 + 20, f"idle {idle:.0%} of every stage's step; stage 0 holds up to "
               f"{peak} microbatches' activations", 17, anchor="end", fill=GREY)
        for r, actions in enumerate(timeline):
            y = y0 + 35 + r * 42
            s.text(20, y + 26, f"stage {r}", 16, anchor="start")
            s.rect(100, y, total * unit, 36, fill="#f9fafb", stroke=LIGHT, rx=2, width=1)
            for kind, mb, start, end in actions:
                x = 100 + start * unit
                fill = PALE[mb] if kind == "F" else RANK_COLOURS[mb]
                s.rect(x, y, (end - start) * unit, 36, fill=fill, stroke=RANK_COLOURS[mb],
                       rx=3, width=1.5)
                s.text(x + (end - start) * unit / 2, y + 24, f"{kind}{mb}", 14,
                       fill=INK if kind == "F" else "white", weight="bold")
        s.text(100, y0 + 225, f"time: forward 1 unit, backward 2 units; a step takes {total} "
               "units", 15, anchor="start", fill=GREY)
    theory = pipeline_bubble_fraction(stages, microbatches)
    s.text(600, 545, f"bubble (p-1)/(m+p-1) = 3/11 = {theory:.0%} for both; 1F1B starts "
           "backwards early and frees activations sooner", 18)
    return s


# ------------------------------------------------------------------------------ data
def sampler() -> Svg:
    """Which sample each rank reads: the real samplers, called here."""
    n_train, n_eval, world = 10, 10, 4
    s = Svg(1200, 520, "DistributedSampler and DistributedEvalSampler, 10 samples on 4 ranks")
    dataset = list(range(n_train))
    s.text(10, 30, "DistributedSampler(..., shuffle=True, seed=0, drop_last=True)", 22,
           anchor="start", mono=True, weight="bold")

    def cells(x, y, idx, r, pad_from=None):
        for j, i in enumerate(idx):
            pad = pad_from is not None and i >= pad_from
            s.rect(x + j * 72, y, 64, 52, fill="white" if pad else PALE[r],
                   stroke=GREY if pad else RANK_COLOURS[r], rx=5, width=2.5,
                   dash="6 4" if pad else None)
            s.text(x + j * 72 + 32, y + 35, "pad" if pad else i, 19 if pad else 25,
                   weight="bold", fill=GREY if pad else INK)

    for e, epoch in enumerate((0, 1)):
        y0 = 45 + e * 125
        s.text(10, y0 + 52, f"set_epoch({epoch})", 20, anchor="start", mono=True)
        for r in range(world):
            sampler = DistributedSampler(dataset, num_replicas=world, rank=r, shuffle=True,
                                         seed=0, drop_last=True)
            sampler.set_epoch(epoch)
            idx = list(sampler)
            x = 215 + r * 250
            s.text(x + len(idx) * 36 - 4, y0 + 20, f"rank {r}", 20, fill=RANK_COLOURS[r],
                   weight="bold")
            cells(x, y0 + 28, idx, r)
        used = {i for r in range(world) for i in DistributedSampler(
            dataset, num_replicas=world, rank=r, shuffle=True, seed=0, drop_last=True)}
        dropped = ", ".join(str(i) for i in sorted(set(dataset) - used))
        s.text(215, y0 + 108, f"disjoint, equal shards; left out this epoch: {dropped}"
               if epoch == 0 else "a new order every epoch, the same on every rank", 20,
               anchor="start", fill=GREY)
    y0 = 330
    s.text(10, y0, "DistributedEvalSampler(ds, num_replicas=4, rank=r)", 22, anchor="start",
           mono=True, weight="bold")
    ds = list(range(n_eval))
    for r in range(world):
        idx = list(DistributedEvalSampler(ds, num_replicas=world, rank=r))
        x = 215 + r * 250
        s.text(x + len(idx) * 36 - 4, y0 + 40, f"rank {r}", 20, fill=RANK_COLOURS[r],
               weight="bold")
        cells(x, y0 + 48, idx, r, pad_from=n_eval)
    s.text(10, y0 + 82, "evaluation", 20, anchor="start")
    s.text(600, y0 + 140, "every sample exactly once; a padding sample's targets are ignored: "
           "it counts nowhere", 20, fill=GREY)
    s.text(600, y0 + 172, "and every rank runs the same number of batches", 20, fill=GREY)
    return s


def storage() -> Svg:
    s = Svg(1200, 420, "where the course's data lives on a cluster")
    s.rect(20, 30, 330, 160, fill="#f3f4f6")
    s.text(185, 65, "login node (internet)", 20, weight="bold")
    s.text(185, 105, "python prepare_data.py", 17, mono=True)
    s.text(185, 135, "downloads WikiText-2 once,", 16, fill=GREY)
    s.text(185, 160, "tokenises it into one file", 16, fill=GREY)
    s.arrow(350, 110, 440, 110)
    s.rect(440, 20, 340, 380, fill="#fef9c3", stroke="#ca8a04", width=2)
    s.text(610, 55, "project / scratch file system", 19, weight="bold")
    s.text(610, 80, "(parallel, seen by every node)", 16, fill=GREY)
    for j, (name, note) in enumerate((("data_cache/", "$COURSE_DATA_CACHE: one .pt file"),
                                      ("runs/<job>-<id>/", "OUT_DIR: logs, summary.json"),
                                      ("  checkpoints/last/", "DCP: one file per rank"),
                                      (".venv/", "VENV: the Python environment"))):
        y = 110 + j * 70
        s.rect(460, y, 300, 56, fill="white", stroke="#ca8a04")
        s.text(475, y + 24, name, 16, anchor="start", mono=True, weight="bold")
        s.text(475, y + 46, note, 14, anchor="start", fill=GREY)
    for n in range(NODES):
        y = 40 + n * 190
        s.rect(870, y, 310, 160, fill="#f9fafb")
        s.text(1025, y + 32, f"compute node {n} (no internet)", 18, weight="bold")
        s.text(1025, y + 65, "HF_HUB_OFFLINE=1", 15, mono=True)
        s.text(1025, y + 92, "reads the cache in < 1 s,", 15, fill=GREY)
        s.text(1025, y + 115, "windows are slices of a tensor", 15, fill=GREY)
        s.text(1025, y + 138, "in memory: no file per sample", 15, fill=GREY)
        s.arrow(780, 160 + n * 60, 868, y + 80)
    s.rect(20, 230, 330, 150, fill="white", stroke="#dc2626", width=2, dash="7 5")
    s.text(185, 265, "$HOME", 20, weight="bold", fill="#dc2626")
    s.text(185, 298, "small quota, often slow or", 16, fill=GREY)
    s.text(185, 322, "backed up: not for data,", 16, fill=GREY)
    s.text(185, 346, "caches or checkpoints", 16, fill=GREY)
    return s


FIGURES = {
    "ranks": ranks, "rendezvous": rendezvous, "collectives": collectives, "ddp": ddp,
    "fsdp": fsdp, "tp": tp, "mesh": mesh, "pp-stages": pp_stages, "pp-schedule": pp_schedule,
    "sampler": sampler, "storage": storage,
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
