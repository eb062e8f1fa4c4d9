"""Write the pages to play with, docs/pages/*.html, from the course's own code.

    python tools/pages.py           # write docs/pages/{data-parallel,pipeline,memory}.html
    python tools/pages.py --check   # exit 1 if a committed page differs from what it writes now

Each page is one HTML file with its script and style inside: it opens from the file (no server)
and needs no network. Sliders and menus change the inputs; a picture and the formula's numbers
follow. Where the numbers come from:
- memory.html: tools/memory_plan.py's `plan` and utils/memory.py's `predict` (with
  `param_counts`, `activation_bytes_per_token`, `bytes_per_param`, the model presets), not a
  copy: tools/py_to_js.py translates the Python functions into the page's JavaScript, here, so
  the page computes what `python tools/memory_plan.py` prints for the same flags (--check fails
  when the Python changed and the page was not written again; tests/test_pages.py also sets the
  inputs in a browser and compares the page's numbers with memory_plan's JSON).
- pipeline.html: the order of every rank's forward and backward passes is the one torch's own
  schedule classes produce (utils/pipeline_timeline.py's schedule_order, run here for 2 to 8
  ranks and up to 16 microbatches, stored in the page); the bubble formula is translated from
  utils/pipeline_timeline.py's `bubble_formula`; the timing, each action as soon as its input
  exists, is a JavaScript copy of `simulate` there, held to it by tests/test_pages.py.
- data-parallel.html: the gradients of the course's presets in the order backward produces
  them (the real model, built on the meta device), cut into buckets as DDP's Reducer does and
  costed with the collectives step's alpha-beta formula (solutions/train/collectives.py:
  ddp_bucket_bytes, predict_ddp_allreduce_s); the page's few lines that do the same in
  JavaScript are held to those functions by tests/test_pages.py.
"""

from __future__ import annotations

import argparse
import html
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "docs" / "pages"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import torch  # noqa: E402

import memory_plan  # noqa: E402
from model import TransformerLM, get_config  # noqa: E402
from model.transformer import PRESETS, ModelConfig  # noqa: E402
from py_to_js import translate  # noqa: E402
from utils import memory, pipeline_timeline  # noqa: E402

STYLE = """
body { font-family: DejaVu Sans, Helvetica, Arial, sans-serif; margin: 1.2em 2em; color: #1f2937;
       max-width: 1200px; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; }
p.lead { color: #4b5563; margin-top: 0; }
.controls { display: grid; grid-template-columns: repeat(auto-fill, minmax(260px, 1fr));
            gap: 0.6em 1.5em; background: #f3f4f6; padding: 0.8em 1em; border-radius: 8px; }
.controls label { display: flex; flex-direction: column; font-size: 0.9em; }
.controls label span { font-weight: bold; }
.numbers { display: flex; flex-wrap: wrap; gap: 0.5em 2em; margin: 0.8em 0; }
.numbers div { font-size: 0.95em; }
.numbers output { font-weight: bold; font-size: 1.15em; }
.error { color: #b91c1c; font-weight: bold; }
svg { width: 100%; height: auto; }
table { border-collapse: collapse; font-size: 0.9em; }
td, th { padding: 0.15em 0.7em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
.note { font-size: 0.85em; color: #4b5563; }
"""

# one colour per microbatch or bucket (the slides' palette)
COLOURS = ["#2563eb", "#16a34a", "#ea580c", "#9333ea", "#0891b2", "#ca8a04", "#db2777", "#4b5563"]


def page(title: str, lead: str, body: str, script: str) -> str:
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(title)}</title>
<style>{STYLE}</style></head>
<body>
<h1>{html.escape(title)}</h1>
<p class="lead">{lead}</p>
{body}
<script>
const COLOURS = {json.dumps(COLOURS)};
function el(id) {{ return document.getElementById(id); }}
function num(id) {{ return Number(el(id).value); }}
function show(id, value, text) {{ const o = el(id); o.dataset.value = String(value); o.textContent = text; }}
function svgNode(name, attrs, text) {{
  const n = document.createElementNS("http://www.w3.org/2000/svg", name);
  for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v);
  if (text !== undefined) n.textContent = text;
  return n;
}}
{script}
</script>
</body></html>
"""


# ---------------------------------------------------------------------------- memory
MEMORY_BODY = """
<div class="controls">
<label><span>model</span><select id="model">
  <option value="workshop">workshop preset (108M, the course's)</option>
  <option value="small">small preset</option><option value="tiny">tiny preset</option>
  <option value="1e9">1B parameters (Llama-like shape)</option>
  <option value="7e9" selected>7B parameters</option><option value="13e9">13B parameters</option>
  <option value="70e9">70B parameters</option><option value="405e9">405B parameters</option>
</select></label>
<label><span>GPUs: <output id="gpus-shown"></output></span>
  <input id="gpus" type="range" min="0" max="10" value="3"></label>
<label><span>memory of one GPU</span><select id="gpu-memory">
  <option value="16">16 GiB</option><option value="24">24 GiB</option><option value="40">40 GiB</option>
  <option value="64">64 GiB (MI250X GCD)</option><option value="80" selected>80 GiB (A100, H100)</option>
  <option value="96">96 GiB (GH200)</option><option value="141">141 GiB (H200)</option>
  <option value="192">192 GiB (MI300X)</option></select></label>
<label><span>sequences per GPU and step: <output id="batch-shown"></output></span>
  <input id="batch" type="range" min="1" max="64" value="1"></label>
<label><span>tokens per sequence</span><select id="seq-len">
  <option value="">the preset's (4096 for a parameter count)</option><option value="256">256</option>
  <option value="1024">1024</option><option value="2048">2048</option><option value="4096">4096</option>
  <option value="8192">8192</option></select></label>
<label><span>tensor parallel (--tp)</span><select id="tp">
  <option>1</option><option>2</option><option>4</option><option>8</option></select></label>
<label><span>pipeline stages (--pp)</span><select id="pp">
  <option>1</option><option>2</option><option>4</option><option>8</option><option>16</option></select></label>
<label><span>precision</span><select id="precision">
  <option value="bf16">bf16 autocast (fp32 weights)</option><option value="fp32">fp32</option></select></label>
</div>
<p id="command" class="note"></p>
<div id="error" class="error"></div>
<svg id="picture" viewBox="0 0 1100 470" role="img" aria-label="bytes per GPU by layout"></svg>
<table id="table"><thead><tr><th>GiB per GPU</th><th>parameters</th><th>gradients</th>
<th>optimizer</th><th>activations</th><th>gathered</th><th>total</th><th>fits?</th></tr></thead>
<tbody></tbody></table>
<p class="note">The formula (docs/memory.md): per parameter 4 bytes of weights, 4 of gradients,
8 of AdamW moments, divided by the ranks that shard each (ZeRO-1 the optimizer state, ZeRO-2 also
the gradients, ZeRO-3/FSDP also the weights; TP splits the matrices); activations per token and
layer from the model's shape; with pipeline stages the first stage, holding at most
<i>pp</i> microbatches (1F1B). "Fits" leaves 10% of the GPU for the CUDA context, NCCL and the
allocator. The same numbers as <code>python tools/memory_plan.py</code>; the code: utils/memory.py
(predict), translated into this page by tools/pages.py.</p>
"""

MEMORY_SCRIPT = """
const GPU_CHOICES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024];
const PARTS = ["parameters", "gradients", "optimizer", "activations", "gathered"];
function modelConfig() {
  const m = el("model").value, seq = el("seq-len").value ? Number(el("seq-len").value) : null;
  if (m in PRESETS) {  // as tools/memory_plan.py --preset: WikiText-2's vocabulary, no dropout
    return [ModelConfig({...PRESETS[m], vocab_size: 33278, dropout: 0.0,
                         max_seq_len: seq || PRESETS[m].max_seq_len}), null];
  }
  return [shape_for(Number(m), 32000, seq || 4096), Number(m)];  // as --params
}
function update() {
  const gpus = GPU_CHOICES[num("gpus")], memory = num("gpu-memory"), batch = num("batch");
  const tp = num("tp"), pp = num("pp"), precision = el("precision").value;
  el("gpus-shown").textContent = gpus;
  el("batch-shown").textContent = batch;
  const m = el("model").value;
  el("command").textContent = "python tools/memory_plan.py " +
    (m in PRESETS ? `--preset ${m}` : `--params ${m}`) + ` --gpus ${gpus} --gpu-memory ${memory}` +
    ` --batch-size ${batch} --tp ${tp} --pp ${pp} --precision ${precision}` +
    (el("seq-len").value ? ` --seq-len ${el("seq-len").value}` : "");
  const [cfg, params] = modelConfig();
  let result;
  try {
    result = plan(cfg, gpus, memory, batch, tp, pp, precision, params);
    el("error").textContent = "";
  } catch (e) {
    el("error").textContent = e.message;
    el("picture").replaceChildren();
    el("table").tBodies[0].replaceChildren();
    return;
  }
  draw(result, memory);
}
function draw(result, memory) {
  const svg = el("picture"), body = el("table").tBodies[0];
  svg.replaceChildren();
  body.replaceChildren();
  const rows = Object.entries(result.layouts), left = 330, width = 680, top = 34, h = 44;
  const most = 1.1 * Math.max(memory * GiB, ...rows.map(([, r]) => r.gpu_total));  // room for labels
  const x = (bytes) => left + width * bytes / most;
  rows.forEach(([name, r], i) => {
    const y = top + i * (h + 10);
    svg.append(svgNode("text", {x: 0, y: y + 28, "font-size": 15}, name));
    let at = 0;
    PARTS.forEach((part, k) => {
      const bytes = part === "gathered" || !r.host_total || part === "activations" ? r[part] : 0;
      svg.append(svgNode("rect", {x: x(at), y, width: Math.max(0, x(at + bytes) - x(at)), height: h,
                                  fill: COLOURS[k]}));
      at += bytes;
    });
    svg.append(svgNode("text", {x: x(at) + 6, y: y + 28, "font-size": 15},
                       `${(r.gpu_total / GiB).toFixed(1)} GiB`));
    const tr = document.createElement("tr");
    tr.dataset.layout = name;
    tr.dataset.total = String(r.gpu_total);
    tr.dataset.fits = String(r.fits);
    tr.innerHTML = `<td>${name}</td>` + PARTS.map((p) => `<td>${(r[p] / GiB).toFixed(2)}</td>`).join("") +
      `<td><b>${(r.gpu_total / GiB).toFixed(2)}</b>` +
      (r.host_total ? ` (+${(r.host_total / GiB).toFixed(1)} host)` : "") +
      `</td><td>${r.fits ? "yes" : "NO"}</td>`;
    body.append(tr);
  });
  for (const [bytes, label, anchor] of [[memory * GiB, `${memory} GiB`, "start"],
                                        [USABLE * memory * GiB, "90%", "end"]]) {
    svg.append(svgNode("line", {x1: x(bytes), x2: x(bytes), y1: 10, y2: top + rows.length * (h + 10),
                                stroke: "#b91c1c", "stroke-width": 2, "stroke-dasharray": "6 4"}));
    svg.append(svgNode("text", {x: x(bytes) + (anchor === "start" ? 4 : -4), y: 22, "font-size": 14,
                                "text-anchor": anchor, fill: "#b91c1c"}, label));
  }
  PARTS.forEach((part, k) => {
    svg.append(svgNode("rect", {x: left + k * 140, y: 448, width: 14, height: 14, fill: COLOURS[k]}));
    svg.append(svgNode("text", {x: left + k * 140 + 20, y: 461, "font-size": 14}, part));
  });
}
for (const id of ["model", "gpus", "gpu-memory", "batch", "seq-len", "tp", "pp", "precision"]) {
  el(id).addEventListener("input", update);
  el(id).addEventListener("change", update);
}
update();
"""


def memory_page() -> str:
    formulas = translate([memory.bytes_per_param, memory.param_counts,
                          memory.activation_bytes_per_token, memory.predict, memory_plan.shape_for,
                          memory_plan.layouts, memory_plan.plan], [memory.Layout, ModelConfig])
    presets = f"const PRESETS = {json.dumps({k: v.to_dict() for k, v in PRESETS.items()})};\n"
    return page("Memory per GPU, by layout",
                "How many bytes one GPU holds for each way of splitting a model: change the model, "
                "the GPUs and the batch, and see which layouts fit.",
                MEMORY_BODY,
                "// utils/memory.py and tools/memory_plan.py, translated by tools/py_to_js.py\n"
                + formulas + presets + MEMORY_SCRIPT)


# ---------------------------------------------------------------------------- pipeline
SCHEDULES = {"gpipe": [1], "1f1b": [1], "interleaved-1f1b": [2, 3, 4], "zero-bubble": [1, 2]}
RANKS, MAX_MICROBATCHES = range(2, 9), 16
ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
KIND_CODES = "FBIW"


def encode(order) -> list[str]:
    """Every rank's actions, two characters each: (stage x 4 + kind) x 32 + microbatch."""
    out = []
    for rank in order:
        s = ""
        for stage, kind, mb in rank:
            code = (stage * 4 + KIND_CODES.index(kind)) * 32 + mb
            s += ALPHABET[code // 64] + ALPHABET[code % 64]
        out.append(s)
    return out


def schedule_orders() -> tuple[dict, dict]:
    """{"schedule/ranks/microbatches/stages per rank": encoded order} from torch's classes, and
    the combinations torch refuses, with its reason."""
    orders, refused = {}, {}
    for schedule, per_rank in SCHEDULES.items():
        cls = pipeline_timeline.schedule_class(pipeline_timeline.SCHEDULE_CLASSES[schedule])
        for p in RANKS:
            for m in range(p, MAX_MICROBATCHES + 1):
                for v in per_rank:
                    key = f"{schedule}/{p}/{m}/{v}"
                    try:
                        orders[key] = encode(pipeline_timeline.schedule_order(cls, p, m, v))
                    except (ValueError, RuntimeError, AssertionError) as e:
                        refused[key] = str(e).split("\n")[0][:160]
    return orders, refused


PIPELINE_BODY = """
<div class="controls">
<label><span>schedule</span><select id="schedule">
  <option value="gpipe">GPipe: all forwards, then all backwards</option>
  <option value="1f1b" selected>1F1B: one forward, one backward</option>
  <option value="interleaved-1f1b">interleaved 1F1B: several stages per rank</option>
  <option value="zero-bubble">zero bubble: backward split into I and W</option></select></label>
<label><span>ranks (pipeline stages): <output id="ranks-shown"></output></span>
  <input id="ranks" type="range" min="2" max="8" value="4"></label>
<label><span>microbatches: <output id="microbatches-shown"></output></span>
  <input id="microbatches" type="range" min="2" max="16" value="8"></label>
<label><span>stages per rank</span><select id="stages-per-rank"></select></label>
<label><span>backward / forward time: <output id="backward-shown"></output></span>
  <input id="backward" type="range" min="1" max="3" step="0.25" value="2"></label>
</div>
<div class="numbers">
<div>bubble, formula: <output id="bubble-formula"></output> <span id="formula-text" class="note"></span></div>
<div>bubble, this picture: <output id="bubble-simulated"></output></div>
<div>step: <output id="step-units"></output> forward times</div>
<div>rank 0 holds the activations of up to <output id="in-flight"></output> microbatches</div>
</div>
<div id="error" class="error"></div>
<svg id="picture" viewBox="0 0 1100 210" role="img" aria-label="pipeline schedule"></svg>
<p class="note">Each row is one rank; a light box is a microbatch's forward (F), a dark one its
backward (B), or for zero bubble its input gradients (I, dark) and weight gradients (W, hatched),
which nothing waits for and which fill the gaps. The order of every rank's boxes is torch's
(torch.distributed.pipelining, __TORCH__); each box starts as soon as its rank is free and its
input exists; sending costs nothing. The formula assumes equal stages, a backward of twice a
forward (zero bubble: I and W one forward each): move the backward slider to see where it stops
being exact. Your own run draws the same picture as it ran: OUT_DIR/pipeline_schedule.html
(docs/pp.md).</p>
"""

PIPELINE_SCRIPT = """
const KINDS = "FBIW";
function decode(ranks) {
  return ranks.map((s) => {
    const out = [];
    for (let i = 0; i < s.length; i += 2) {
      const code = ALPHABET.indexOf(s[i]) * 64 + ALPHABET.indexOf(s[i + 1]);
      out.push([Math.floor(code / 128), KINDS[Math.floor(code / 32) % 4], code % 32]);
    }
    return out;
  });
}
// utils/pipeline_timeline.py's simulate, in JavaScript (tests/test_pages.py holds it to it)
function simulate(order, times) {
  const last = Math.max(...order.flat().map((a) => a[0]));
  const done = new Map(), timeline = order.map(() => []), pos = order.map(() => 0);
  const free = order.map(() => 0), key = (s, k, mb) => `${s}${k}${mb}`;
  const needs = (s, k, mb) => (k === "F" ? (s > 0 ? [key(s - 1, "F", mb)] : [])
    : k === "W" ? [key(s, "I", mb)] : s === last ? [key(s, "F", mb)]
    : [key(s + 1, "B", mb), key(s + 1, "I", mb)]);
  while (order.some((actions, r) => pos[r] < actions.length)) {
    let progressed = false;
    order.forEach((actions, r) => {
      if (pos[r] === actions.length) return;
      const [s, k, mb] = actions[pos[r]], deps = needs(s, k, mb);
      const ready = deps.filter((d) => done.has(d)).map((d) => done.get(d));
      if (deps.length && !ready.length) return;
      const start = Math.max(free[r], ...ready), end = start + times[k];
      done.set(key(s, k, mb), end);
      free[r] = end;
      timeline[r].push([s, k, mb, start, end]);
      pos[r] += 1;
      progressed = true;
    });
    if (!progressed) throw new Error("the schedule's order deadlocks");
  }
  return timeline;
}
function idleShare(timeline) {
  const end = Math.max(...timeline.flat().map((a) => a[4]));
  const busy = timeline.flat().reduce((t, a) => t + a[4] - a[3], 0);
  return 1 - busy / (timeline.length * end);
}
function stagesPerRank() {
  const choices = {"gpipe": [1], "1f1b": [1], "interleaved-1f1b": [2, 3, 4], "zero-bubble": [1, 2]};
  const select = el("stages-per-rank"), keep = select.value;
  const wanted = choices[el("schedule").value];
  if (select.options.length !== wanted.length || [...select.options].some((o, i) => Number(o.value) !== wanted[i])) {
    select.replaceChildren(...wanted.map((v) => new Option(String(v), String(v))));
    select.value = wanted.includes(Number(keep)) ? keep : String(wanted[0]);
  }
}
function update() {
  stagesPerRank();
  const schedule = el("schedule").value, p = num("ranks");
  el("microbatches").min = String(p);  // at least one microbatch per stage
  if (num("microbatches") < p) el("microbatches").value = String(p);
  const m = num("microbatches"), v = num("stages-per-rank"), b = num("backward");
  el("ranks-shown").textContent = p;
  el("microbatches-shown").textContent = m;
  el("backward-shown").textContent = b;
  const [formula, text] = bubble_formula(schedule, p, m, v);
  if (formula === null) show("bubble-formula", "", "none"); else show("bubble-formula", formula, `${(100 * formula).toFixed(1)}%`);
  el("formula-text").textContent = text;
  const key = `${schedule}/${p}/${m}/${v}`;
  if (!(key in ORDERS)) {
    el("error").textContent = REFUSED[key] ? `torch does not build this: ${REFUSED[key]}` : "not in this page's table";
    el("picture").replaceChildren();
    for (const id of ["bubble-simulated", "step-units", "in-flight"]) show(id, "", "-");
    return;
  }
  el("error").textContent = "";
  const times = {F: 1, B: b, I: b / 2, W: b / 2};
  const timeline = simulate(decode(ORDERS[key]), times);
  const share = idleShare(timeline), end = Math.max(...timeline.flat().map((a) => a[4]));
  show("bubble-simulated", share, `${(100 * share).toFixed(1)}%`);
  show("step-units", end, end.toFixed(2).replace(/\\.?0+$/, ""));
  let alive = 0, peak = 0;
  // a microbatch's activations live from its forward to its backward (zero bubble: to its W)
  for (const [, k] of timeline[0]) { alive += k === "F" ? 1 : (k === "I" ? 0 : -1); peak = Math.max(peak, alive); }
  show("in-flight", peak, String(peak));
  draw(timeline, end, v > 1);
}
function draw(timeline, end, showStage) {
  const svg = el("picture"), left = 90, width = 1000, h = 40;
  svg.setAttribute("viewBox", `0 0 1100 ${20 + timeline.length * (h + 6)}`);
  svg.replaceChildren();
  svg.append(svgNode("defs", {}));
  svg.firstChild.innerHTML = '<pattern id="hatch" patternUnits="userSpaceOnUse" width="6" height="6" patternTransform="rotate(45)"><line x1="0" y1="0" x2="0" y2="6" stroke="white" stroke-width="2"/></pattern>';
  const x = (t) => left + width * t / end;
  timeline.forEach((row, r) => {
    const y = 10 + r * (h + 6);
    svg.append(svgNode("text", {x: 0, y: y + h / 2 + 6, "font-size": 16}, `rank ${r}`));
    for (const [s, k, mb, a, b] of row) {
      const colour = COLOURS[mb % COLOURS.length], w = x(b) - x(a);
      svg.append(svgNode("rect", {x: x(a), y, width: w, height: h, fill: colour, stroke: "white",
                                  "fill-opacity": k === "F" ? 0.35 : 1}));
      if (k === "W") svg.append(svgNode("rect", {x: x(a), y, width: w, height: h, fill: "url(#hatch)"}));
      const label = (showStage ? `${s}` : "") + `${k}${mb}`;
      if (w > 9 * label.length) {
        svg.append(svgNode("text", {x: x(a) + w / 2, y: y + h / 2 + 5, "font-size": 13, "text-anchor": "middle",
                                    fill: k === "F" ? "#1f2937" : "white"}, label));
      }
    }
  });
}
for (const id of ["schedule", "ranks", "microbatches", "stages-per-rank", "backward"]) {
  el(id).addEventListener("input", update);
  el(id).addEventListener("change", update);
}
update();
"""


def pipeline_page() -> str:
    orders, refused = schedule_orders()
    formulas = translate([pipeline_timeline.bubble_formula,
                          pipeline_timeline.pipeline_bubble_fraction])
    data = (f"const ALPHABET = {json.dumps(ALPHABET)};\n"
            f"// every rank's actions in torch {torch.__version__.split('+')[0]}'s order\n"
            f"const TORCH_VERSION = {json.dumps(torch.__version__.split('+')[0])};\n"
            f"const ORDERS = {json.dumps(orders, separators=(',', ':'))};\n"
            f"const REFUSED = {json.dumps(refused, separators=(',', ':'))};\n")
    body = PIPELINE_BODY.replace("__TORCH__", f"torch {torch.__version__.split('+')[0]}")
    return page("Pipeline schedules",
                "Stages, microbatches and the schedule: where every rank waits (the bubble), "
                "and what the formula predicts.",
                body,
                "// utils/pipeline_timeline.py's bubble formula, translated by tools/py_to_js.py\n"
                + formulas + data + PIPELINE_SCRIPT)


# ---------------------------------------------------------------------------- data parallel
def load_solution(name: str):
    path = ROOT / "solutions" / "train" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_pages_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gradients(preset: str) -> list[list]:
    """[name, bytes, backward FLOPs per token] of every parameter in the order DDP's Reducer
    fills its buckets (the reverse of the parameters: backward produces the last first)."""
    with torch.device("meta"):
        model = TransformerLM(get_config(preset, vocab_size=33278))
    out = []
    for name, p in reversed(list(model.named_parameters())):
        matmul = p.dim() == 2 and "emb" not in name  # embeddings are lookups: no FLOPs
        out.append([name, p.numel() * p.element_size(), 4 * p.numel() if matmul else 0])
    return out


DP_BODY = """
<div class="controls">
<label><span>model</span><select id="model">
  <option value="workshop" selected>workshop preset (108M)</option><option value="small">small preset</option>
  <option value="tiny">tiny preset</option></select></label>
<label><span>GPUs: <output id="gpus-shown"></output></span>
  <input id="gpus" type="range" min="2" max="64" value="8"></label>
<label><span>bucket_cap_mb: <output id="bucket-shown"></output> MiB</span>
  <input id="bucket" type="range" min="1" max="100" value="25"></label>
<label><span>bus bandwidth: <output id="busbw-shown"></output> GB/s</span>
  <input id="busbw" type="range" min="1" max="400" value="20"></label>
<label><span>latency per all-reduce: <output id="latency-shown"></output> µs</span>
  <input id="latency" type="range" min="1" max="200" value="20"></label>
<label><span>compute: <output id="tflops-shown"></output> TFLOP/s</span>
  <input id="tflops" type="range" min="5" max="800" step="5" value="200"></label>
<label><span>tokens per GPU and step: <output id="tokens-shown"></output></span>
  <input id="tokens" type="range" min="8" max="17" value="13"></label>
</div>
<div class="numbers">
<div>buckets: <output id="buckets"></output></div>
<div>all-reduce, formula: <output id="allreduce"></output> per step</div>
<div>backward: <output id="backward"></output></div>
<div>not hidden behind backward: <output id="exposed"></output></div>
</div>
<svg id="picture" viewBox="0 0 1100 300" role="img" aria-label="buckets and all-reduces"></svg>
<p class="note">Backward produces the gradients from the output layer back to the embeddings
(top row, one colour per bucket). DDP collects them into buckets (the first closes at 1 MiB, the
others at bucket_cap_mb) and all-reduces a bucket as soon as it is full (bottom row), while
backward goes on: only what is left after the last gradient costs time. One all-reduce of a
bucket of B bytes on n GPUs costs latency + B x 2(n-1)/n / bus bandwidth (a ring: every byte
crosses every link twice, less its own share); that sum is the formula's number, the same as
train/collectives.py's predict_ddp_allreduce_s (TODO 53), which the collectives step measures.
Compute: 4 FLOPs per weight and token for its backward (the embeddings, lookups, none). More
GPUs make every bucket's all-reduce slower only up to 2x; small buckets pay the latency more
often; one big bucket waits for all of backward before it starts.</p>
"""

DP_SCRIPT = """
const FIRST_BUCKET_BYTES = 2 ** 20;
function buckets(grads, cap) {
  // DDP's Reducer, as solutions/train/collectives.py's ddp_bucket_bytes: in backward order, a
  // bucket closes once it holds FIRST_BUCKET_BYTES (the first) or the cap (the others)
  const out = [];
  let size = 0, limit = FIRST_BUCKET_BYTES, members = [];
  grads.forEach((g, i) => {
    size += g[1];
    members.push(i);
    if (size >= limit) { out.push({bytes: size, members}); size = 0; limit = cap; members = []; }
  });
  if (size) out.push({bytes: size, members});
  return out;
}
function seconds(s) { return s >= 1 ? `${s.toFixed(2)} s` : `${(1e3 * s).toFixed(2)} ms`; }
function update() {
  const grads = GRADIENTS[el("model").value], n = num("gpus"), cap = num("bucket") * 2 ** 20;
  const busbw = num("busbw") * 1e9, latency = num("latency") * 1e-6, flops = num("tflops") * 1e12;
  const tokens = 2 ** num("tokens");
  for (const id of ["gpus", "bucket", "busbw", "latency", "tflops"]) el(`${id}-shown`).textContent = el(id).value;
  el("tokens-shown").textContent = tokens;
  const bs = buckets(grads, cap), factor = 2 * (n - 1) / n;
  // backward: each gradient is ready when its share of the backward FLOPs is done
  let t = 0;
  const ready = grads.map((g) => (t += g[2] * tokens / flops));
  const backward = t;
  let free = 0, total = 0;
  const bars = bs.map((b, i) => {
    const cost = latency + b.bytes * factor / busbw;
    total += cost;
    const start = Math.max(free, ready[b.members[b.members.length - 1]]);
    free = start + cost;
    return {i, start, end: free, first: b.members[0] === 0 ? 0 : ready[b.members[0] - 1],
            last: ready[b.members[b.members.length - 1]]};
  });
  show("buckets", bs.map((b) => b.bytes).join(","), `${bs.length} (${bs.map((b) => (b.bytes / 2 ** 20).toFixed(1)).join(", ")} MiB)`);
  show("allreduce", total, seconds(total));
  show("backward", backward, seconds(backward));
  show("exposed", Math.max(0, free - backward), seconds(Math.max(0, free - backward)));
  draw(bars, Math.max(free, backward), backward);
}
function draw(bars, end, backward) {
  const svg = el("picture"), left = 160, width = 920, x = (t) => left + width * t / end;
  svg.replaceChildren();
  svg.append(svgNode("text", {x: 0, y: 80, "font-size": 17}, "backward"));
  svg.append(svgNode("text", {x: 0, y: 180, "font-size": 17}, "all-reduce"));
  for (const b of bars) {
    const colour = COLOURS[b.i % COLOURS.length];
    svg.append(svgNode("rect", {x: x(b.first), y: 50, width: Math.max(1, x(b.last) - x(b.first)), height: 44, fill: colour, "fill-opacity": 0.45}));
    svg.append(svgNode("rect", {x: x(b.start), y: 150, width: Math.max(1, x(b.end) - x(b.start)), height: 44, fill: colour}));
    svg.append(svgNode("line", {x1: x(b.last), x2: x(b.start), y1: 94, y2: 150, stroke: colour, "stroke-width": 1.5}));
  }
  svg.append(svgNode("line", {x1: x(backward), x2: x(backward), y1: 30, y2: 220, stroke: "#1f2937", "stroke-dasharray": "5 4"}));
  svg.append(svgNode("text", {x: Math.min(x(backward), 1000), y: 240, "font-size": 15, "text-anchor": "middle"}, "backward ends"));
  svg.append(svgNode("text", {x: left, y: 280, "font-size": 15}, `time: 0 to ${seconds(end)}; buckets numbered in the order backward fills them`));
}
for (const id of ["model", "gpus", "bucket", "busbw", "latency", "tflops", "tokens"]) {
  el(id).addEventListener("input", update);
  el(id).addEventListener("change", update);
}
update();
"""


def data_parallel_page() -> str:
    grads = {preset: gradients(preset) for preset in PRESETS}
    return page("Data parallelism: gradient buckets and their all-reduces",
                "How DDP hides its communication behind backward, and when it cannot.",
                DP_BODY,
                f"const GRADIENTS = {json.dumps(grads, separators=(',', ':'))};\n" + DP_SCRIPT)


PAGES = {"data-parallel.html": data_parallel_page, "pipeline.html": pipeline_page,
         "memory.html": memory_page}


def render_all() -> dict[str, str]:
    return {name: build() for name, build in PAGES.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true",
                   help="compare with the committed pages instead of writing them")
    args = p.parse_args(argv)
    stale = []
    for name, text in render_all().items():
        path = OUT_DIR / name
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(name)
        else:
            OUT_DIR.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    if stale:
        print(f"stale: {', '.join(stale)}: run python tools/pages.py and commit docs/pages/",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
