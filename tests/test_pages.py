"""The pages to play with (docs/pages/*.html): each is what tools/pages.py writes from the code
now, opens from its file with nothing fetched from elsewhere, and, in headless Chromium, after
its inputs change, shows the numbers the course's Python computes for the same inputs
(tools/memory_plan.py, utils/pipeline_timeline.py, the collectives step's DDP formula).

Chromium is Debian's `chromium`, installed with apt-get when running as root (tests/browser.py);
without it the browser tests skip with the reason, except in CI (CI=true), where they fail.
"""

from __future__ import annotations

import contextlib
import html
import io
import json
import re
import subprocess
import sys

import pytest

import browser
from conftest import ROOT, load_script

PAGES = ROOT / "docs" / "pages"


def test_every_page_is_what_tools_pages_py_writes_from_the_code_now():
    import torch
    made_with = re.search(r'const TORCH_VERSION = "([^"]+)"', (PAGES / "pipeline.html").read_text())
    if made_with and made_with.group(1) != torch.__version__.split("+")[0]:
        pytest.skip(f"the pipeline page holds torch {made_with.group(1)}'s schedule orders, this "
                    f"is torch {torch.__version__}")
    proc = subprocess.run([sys.executable, "tools/pages.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_pages_fetch_nothing_and_every_slide_deck_that_teaches_one_links_it():
    for page in PAGES.glob("*.html"):
        text = page.read_text()
        assert not re.search(r"""<(script|link|img|iframe)[^>]+(src|href)\s*=""", text), page.name
        assert not re.search(r"""url\(\s*["']?(https?:)?//""", text), page.name
    decks = {"data-parallel.html": "01-ddp.md", "pipeline.html": "04-pp.md",
             "memory.html": "02b-memory.md"}
    for page, deck in decks.items():
        assert f"../docs/pages/{page}" in (ROOT / "slides" / deck).read_text(), (deck, page)


# ------------------------------------------------------------------ in the browser
CATCH_ERRORS = ('<script>window.pageErrors = []; '
                'addEventListener("error", (e) => pageErrors.push(e.message));</script>')
HARNESS = """
<script>
(() => {
  const results = [];
  for (const change of CASES) {
    for (const [id, value] of change) {  // as a person would: set the input, and it says so
      const input = document.getElementById(id);
      input.value = String(value);
      input.dispatchEvent(new Event("input", {bubbles: true}));
      input.dispatchEvent(new Event("change", {bubbles: true}));
    }
    const read = {error: document.getElementById("error") ? document.getElementById("error").textContent : ""};
    for (const o of document.querySelectorAll("output[data-value]")) read[o.id] = o.dataset.value;
    read.layouts = Object.fromEntries([...document.querySelectorAll("tr[data-layout]")].map(
      (r) => [r.dataset.layout, [Number(r.dataset.total), r.dataset.fits === "true"]]));
    read.boxes = document.querySelectorAll("#picture rect").length;
    results.push(read);
  }
  const pre = document.createElement("pre");
  pre.id = "page-report";
  pre.textContent = JSON.stringify({errors: window.pageErrors, results});
  document.body.append(pre);
})();
</script>
"""


@pytest.fixture(scope="module")
def chromium() -> str:
    found = browser.chromium()
    if found is None:
        why = "no Chromium: install Debian's `chromium` (apt-get as root) or set CHROME_PATH"
        if browser.IN_CI:
            pytest.fail(f"CI=true but {why}", pytrace=False)
        pytest.skip(why)
    return found


def in_browser(chromium: str, name: str, cases: list[list[tuple]], tmp_path) -> list[dict]:
    """Open docs/pages/NAME as a file, make each case's changes in turn, read what it shows."""
    text = (PAGES / name).read_text()
    copy = tmp_path / name
    copy.write_text(text.replace("<head>", "<head>" + CATCH_ERRORS, 1).replace(
        "</body>", f"<script>const CASES = {json.dumps(cases)};</script>{HARNESS}</body>"))
    proc = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu",
                           "--no-first-run", "--disable-background-networking",
                           "--dump-dom", copy.as_uri()],
                          capture_output=True, text=True, timeout=180)
    found = re.search(r'<pre id="page-report">(.*?)</pre>', proc.stdout, re.S)
    assert found, f"{name}: Chromium returned no report: {proc.stderr[-2000:]}"
    report = json.loads(html.unescape(found.group(1)))
    assert report["errors"] == [], f"{name}: the page's script failed: {report['errors']}"
    return report["results"]


MEMORY_CASES = {  # the page's inputs, and the same as memory_plan flags
    "7B on 8 GPUs, tp 2 x pp 2": ([("model", "7e9"), ("gpus", 3), ("gpu-memory", 80), ("batch", 4),
                                   ("tp", 2), ("pp", 2), ("precision", "bf16")],
                                  ["--params", "7e9", "--gpus", "8", "--gpu-memory", "80",
                                   "--batch-size", "4", "--tp", "2", "--pp", "2"]),
    "the workshop preset on 4 GPUs of 40 GiB": (
        [("model", "workshop"), ("gpus", 2), ("gpu-memory", 40), ("batch", 32), ("seq-len", 1024),
         ("tp", 1), ("pp", 1), ("precision", "fp32")],
        ["--preset", "workshop", "--gpus", "4", "--gpu-memory", "40", "--batch-size", "32",
         "--seq-len", "1024", "--precision", "fp32"]),
    "70B on 64 GPUs, tp 8 x pp 4": (
        [("model", "70e9"), ("gpus", 6), ("gpu-memory", 80), ("batch", 1), ("seq-len", 8192),
         ("tp", 8), ("pp", 4), ("precision", "bf16")],
        ["--params", "70e9", "--gpus", "64", "--gpu-memory", "80", "--batch-size", "1",
         "--seq-len", "8192", "--tp", "8", "--pp", "4"]),
    "more model-parallel ranks than GPUs": (
        [("model", "13e9"), ("gpus", 3), ("seq-len", ""), ("tp", 8), ("pp", 2)],
        ["--params", "13e9", "--gpus", "8", "--gpu-memory", "80", "--batch-size", "1",
         "--tp", "8", "--pp", "2"]),
}


def memory_plan_says(flags: list[str], tmp_path) -> dict | str:
    """tools/memory_plan.py's JSON for these flags, or the one line it stops with."""
    memory_plan = load_script("tools/memory_plan.py")
    out = tmp_path / "plan.json"
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            memory_plan.main([*flags, "--json", str(out)])
    except SystemExit as stop:
        return str(stop)
    return json.loads(out.read_text())


def test_the_memory_page_shows_what_tools_memory_plan_py_prints(chromium, tmp_path):
    shown = in_browser(chromium, "memory.html", [c for c, _ in MEMORY_CASES.values()], tmp_path)
    for (name, (_, flags)), page in zip(MEMORY_CASES.items(), shown, strict=True):
        want = memory_plan_says(flags, tmp_path)
        if isinstance(want, str):
            assert page["error"] == want and not page["layouts"], name
            continue
        assert page["error"] == "", name
        assert list(page["layouts"]) == list(want["layouts"]), name
        for layout, row in want["layouts"].items():
            total, fits = page["layouts"][layout]
            assert total == pytest.approx(row["gpu_total"], rel=1e-12), (name, layout)
            assert fits == row["fits"], (name, layout)
        assert page["boxes"] >= 7, name  # a bar per layout


PIPELINE_CASES = [  # schedule, ranks, microbatches, stages per rank, backward / forward time
    ("1f1b", 4, 8, 1, 2), ("gpipe", 2, 3, 1, 1), ("interleaved-1f1b", 4, 8, 2, 2),
    ("interleaved-1f1b", 3, 12, 3, 2.5), ("zero-bubble", 4, 8, 1, 2), ("zero-bubble", 2, 6, 2, 1.5),
    ("interleaved-1f1b", 4, 9, 2, 2),  # 9 microbatches in rounds of 4: torch refuses
]


def test_the_pipeline_page_shows_the_formula_and_torch_s_order_timed(chromium, tmp_path):
    from utils.pipeline_timeline import (SCHEDULE_CLASSES, bubble_formula, idle_share,
                                         schedule_order, simulate)
    cases = [[("schedule", s), ("ranks", p), ("microbatches", m), ("stages-per-rank", v),
              ("backward", b)] for s, p, m, v, b in PIPELINE_CASES]
    shown = in_browser(chromium, "pipeline.html", cases, tmp_path)
    for (schedule, p, m, v, b), page in zip(PIPELINE_CASES, shown, strict=True):
        formula, _ = bubble_formula(schedule, p, m, v)
        assert float(page["bubble-formula"]) == pytest.approx(formula, rel=1e-12)
        try:
            order = schedule_order(SCHEDULE_CLASSES[schedule], p, m, v)
        except (ValueError, RuntimeError) as refused:
            assert page["error"].startswith("torch does not build this"), (schedule, p, m, v)
            assert str(refused).split("\n")[0][:40] in page["error"]
            continue
        timeline = simulate(order, {"F": 1, "B": b, "I": b / 2, "W": b / 2})
        case = (schedule, p, m, v, b)
        assert page["error"] == "", case
        assert float(page["bubble-simulated"]) == pytest.approx(idle_share(timeline), rel=1e-9), case
        assert float(page["step-units"]) == pytest.approx(max(a[4] for r in timeline for a in r)), case
        assert page["boxes"] == sum(len(r) for r in order) + sum(a[1] == "W" for r in order
                                                                 for a in r), case


DP_CASES = [  # model, GPUs, bucket_cap_mb, bus bandwidth GB/s, latency us, TFLOP/s, log2 tokens
    ("workshop", 8, 25, 20, 20, 200, 13), ("workshop", 64, 5, 100, 5, 400, 15),
    ("small", 2, 1, 10, 50, 50, 10),
]


def test_the_data_parallel_page_shows_the_collectives_step_s_ddp_formula(chromium, tmp_path):
    import torch
    from model import TransformerLM, get_config
    collectives = load_script("solutions/train/collectives.py")
    cases = [[("model", model), ("gpus", n), ("bucket", cap), ("busbw", bw), ("latency", us),
              ("tflops", tf), ("tokens", tokens)] for model, n, cap, bw, us, tf, tokens in DP_CASES]
    shown = in_browser(chromium, "data-parallel.html", cases, tmp_path)
    for (model, n, cap, bw, us, _, _), page in zip(DP_CASES, shown, strict=True):
        with torch.device("meta"):
            net = TransformerLM(get_config(model, vocab_size=33278))
        collectives.BUCKET_BYTES = cap * 2**20  # what bucket_cap_mb sets
        assert [int(b) for b in page["buckets"].split(",")] == collectives.ddp_bucket_bytes(net)
        want = collectives.predict_ddp_allreduce_s(net, n, us * 1e-6, bw * 1e9)
        assert float(page["allreduce"]) == pytest.approx(want, rel=1e-12), (model, n, cap)
        assert 0 <= float(page["exposed"]) <= want
