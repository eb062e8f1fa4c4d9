"""The slides: every deck renders, no slide runs past its page, code and diagram labels are
large enough to read, no label runs out of its box or over another, the diagrams are what
tools/figures.py draws from the code now, and no bullet has a hard line break.

The rendering test uses marp-cli (pinned, installed with npm into a cache folder outside the
repository) and headless Chromium (Debian's `chromium`, installed with apt-get when running as
root). Without them it skips with the reason, except in CI (CI=true), where it fails.

    .venv/bin/python -m pytest tests/test_slides.py
"""

from __future__ import annotations

import fcntl
import html
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import browser
from conftest import load_script
from distributed import run_distributed

ROOT = Path(__file__).resolve().parents[1]
SLIDES = ROOT / "slides"
FIGURES = SLIDES / "figures"
MARP_VERSION = "4.5.1"  # also in README.md ("Slides"): keep them equal
TOOLS_DIR = Path(os.environ.get("SLIDES_TOOLS_DIR",
                                Path.home() / ".cache" / "course-slides" / f"marp-cli-{MARP_VERSION}"))
IN_CI = os.environ.get("CI", "").lower() in ("true", "1", "yes")
# Code is readable from the back of a room down to this size on a 1280 x 720 slide (marp
# shrinks a wide code block until it fits: a long line makes all of the block small).
MIN_CODE_PX = 18.0
# The fonts every deck pins in its style (test_every_deck_pins_the_fonts_the_test_installs), and
# the Debian package that has them: the same text then takes the same room on every machine.
# Every slide keeps this much room under its lowest line (px of the 720 px slide): the fonts are
# pinned (FONTS), but another Chromium or FreeType lays the same text out a few pixels apart.
ROOM_PX = 8
# A diagram's labels, as shown on the slide (the SVG's font size x displayed width / SVG width).
MIN_DIAGRAM_PX = 16.0
FIGURE_REF = re.compile(r"\]\((figures/[^)\s]+)\)|(?:src|href)=\"(figures/[^\"]+)\"")


def decks() -> list[Path]:
    return sorted(SLIDES.glob("*.md"))


# ------------------------------------------------------------------ without any tools
def test_every_committed_figure_is_what_tools_figures_py_draws_from_the_code_now():
    proc = subprocess.run([sys.executable, "tools/figures.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr


def _call_collectives(rank, world_size, collectives):
    """Each collective of the figure, called by the name the figure gives it, on this rank's
    input; what this rank holds afterwards."""
    import torch
    import torch.distributed as dist
    held = {}
    for name, call, inputs in collectives:
        t = torch.tensor(inputs[rank])
        if call.startswith("broadcast("):
            dist.broadcast(t, src=0)
        elif call.startswith("all_reduce("):
            dist.all_reduce(t)
        elif call == "all_gather_into_tensor":
            out = torch.empty(t.numel() * world_size, dtype=t.dtype)
            dist.all_gather_into_tensor(out, t)
            t = out
        elif call == "reduce_scatter_tensor":
            out = torch.empty(t.numel() // world_size, dtype=t.dtype)
            dist.reduce_scatter_tensor(out, t)
            t = out
        else:
            raise ValueError(f"the figure names a call this test does not know: {call}")
        held[name] = t.tolist()
    return held


def test_the_collectives_figure_shows_what_torch_distributed_computes():
    figures = load_script("tools/figures.py")
    world = len(figures.COLLECTIVES[0][2])
    held = run_distributed(_call_collectives, world, figures.COLLECTIVES, timeout=120)
    for name, _, inputs in figures.COLLECTIVES:
        assert [held[r][name] for r in range(world)] == \
            figures.reference_collective(name, inputs), name


def test_decks_show_only_figures_that_exist_and_every_figure_is_shown():
    used = set()
    for deck in decks():
        for ref in (a or b for a, b in FIGURE_REF.findall(deck.read_text())):
            assert (SLIDES / ref).is_file(), f"{deck.name} shows {ref}, which does not exist"
            used.add(Path(ref).name)
    unused = sorted(p.name for p in FIGURES.glob("*.svg") if p.name not in used)
    assert not unused, f"figures no deck shows: {unused}"


# Every deck is written to the rule "slides explain the idea and show the shape; the TODO
# comment and the hints name the API and the place; only the last hint gives the lines": no
# deck shows a line of any TODO's solution (any course source: a recap shows earlier steps too).
COURSE_SOURCES = sorted((ROOT / "course").rglob("*.py")) + sorted((ROOT / "course").glob("*.sbatch"))


def squeeze(text: str) -> str:
    return re.sub(r"\s+", "", text)


def solution_lines_shown(deck_text: str, source: Path) -> list[tuple[int, str]]:
    """(TODO, line) of every solution line of `source` (16 characters or more, not a comment)
    that `deck_text` shows, spaces ignored."""
    sys.path.insert(0, str(ROOT))
    from selfcheck.steps.common import solution_blocks
    slides = squeeze(deck_text)
    return [(todo, line.strip()) for todo, lines in solution_blocks(source.read_text())
            for line in lines if len(squeeze(line)) >= 16 and not line.strip().startswith("#")
            and squeeze(line) in slides]


@pytest.mark.parametrize("deck", decks(), ids=lambda d: d.name)
def test_a_deck_shows_the_idea_of_its_todos_not_their_lines(deck):
    text = deck.read_text()
    shown = [f"{source.relative_to(ROOT)} TODO {todo}: {line}" for source in COURSE_SOURCES
             for todo, line in solution_lines_shown(text, source)]
    assert not shown, f"slides/{deck.name} shows solution lines:\n" + "\n".join(shown)


def test_the_rule_finds_a_solution_line_on_a_slide():
    source = ROOT / "course" / "train" / "to_distributed_training.py"
    deck = "# TODO 2\n```python\nlocal_rank, rank, device, world_size = setup(args.seed, args.device)\n```"
    assert solution_lines_shown(deck, source) == [
        (2, "local_rank, rank, device, world_size = setup(args.seed, args.device)")]
    assert solution_lines_shown("- `setup` returns the ranks, the device and the world size",
                                source) == []


def test_every_deck_pins_the_fonts_the_test_installs():
    for deck in decks():
        head = deck.read_text().split("\n---\n", 1)[0]
        style = re.search(r"^style: \|\n((?:  .*\n?)+)", head, re.M)
        assert style, f"{deck.name}: no style in its front matter"
        css = style.group(1)
        assert re.search(r'section \{ font-family: "DejaVu Sans", sans-serif; \}', css), deck.name
        assert re.search(r'section pre, section code \{ font-family: "DejaVu Sans Mono", '
                         r"monospace; \}", css), deck.name


def test_every_deck_is_marp_and_sorts_in_course_order():
    names = [d.name for d in decks()]
    assert names[:5] == ["00a-why.md", "00b-ranks.md", "00c-collectives.md",
                         "00c2-collective-costs.md", "00d-data.md"]
    for deck in decks():
        head = deck.read_text().split("\n---\n", 1)[0]
        assert head.startswith("---\n") and "marp: true" in head, f"{deck.name}: no marp front matter"


def bullet_continuations(text: str) -> list[str]:
    """Lines that continue a list item's text on the next source line. Marp renders them with a
    hard line break (markdown `breaks`), which looks like a ragged half-empty line on a slide."""
    found, in_code, prev_item = [], False, False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            in_code, prev_item = not in_code, False
            continue
        if in_code:
            continue
        item = re.match(r"\s*(?:[-*+]|\d+\.)\s+\S", line) is not None
        if prev_item and not item and line.strip() and line[:1].isspace():
            found.append(line.strip())
        prev_item = item or (prev_item and bool(line.strip()) and line[:1].isspace())
    return found


def test_no_bullet_continues_on_a_second_source_line():
    for deck in decks():
        lines = bullet_continuations(deck.read_text())
        assert not lines, f"{deck.name}: write each bullet on one line; continued: {lines[:3]}"


def test_the_bullet_check_finds_a_continued_bullet():
    assert bullet_continuations("- one\n  two\n- three\n") == ["two"]
    assert bullet_continuations("- one\n  - nested\n\ntext\n```\n- a\n  b\n```\n") == []


def test_readme_pins_the_marp_version_the_tests_use():
    readme = (ROOT / "README.md").read_text()
    assert f"@marp-team/marp-cli@{MARP_VERSION}" in readme
    for deck in decks():
        assert f"slides/{deck.name}" in readme or deck.name.startswith("05-"), \
            f"README.md does not link slides/{deck.name}"


# ------------------------------------------------------------------ rendering
def _unavailable(why: str):
    if IN_CI:
        pytest.fail(f"CI=true but the slides cannot be rendered: {why}", pytrace=False)
    pytest.skip(f"slides not rendered: {why}")


def _install_marp(log: Path) -> Path | None:
    marp = TOOLS_DIR / "node_modules" / ".bin" / "marp"
    if marp.exists():
        return marp
    if not shutil.which("npm"):
        return None
    with open(log, "w") as out:
        proc = subprocess.run(["npm", "install", "--prefix", str(TOOLS_DIR), "--no-audit",
                               "--no-fund", "--no-save", f"@marp-team/marp-cli@{MARP_VERSION}"],
                              stdout=out, stderr=subprocess.STDOUT, timeout=600)
    return marp if proc.returncode == 0 and marp.exists() else None


@pytest.fixture(scope="session")
def tools() -> tuple[Path, str]:
    """(marp, chromium), installed on first use; one installer at a time (a file lock)."""
    TOOLS_DIR.mkdir(parents=True, exist_ok=True)
    with open(TOOLS_DIR.parent / f"{TOOLS_DIR.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not shutil.which("node"):
            _unavailable("node is not installed (marp-cli needs Node.js 18 or later)")
        marp = _install_marp(TOOLS_DIR / "npm.log")
        if marp is None:
            _unavailable(f"could not install @marp-team/marp-cli@{MARP_VERSION} with npm "
                         f"into {TOOLS_DIR} (see npm.log there)")
        chromium = browser.chromium()
        if chromium is None:
            _unavailable("no Chromium: install Debian's `chromium` (apt-get as root) or set "
                         "CHROME_PATH")
        if browser.missing_fonts():
            _unavailable(f"the fonts the decks pin are not installed "
                         f"({', '.join(browser.missing_fonts())}): apt-get install "
                         f"{browser.FONTS_PACKAGE} (as root)")
    return marp, chromium


def render_and_measure(marp: Path, chromium: str, slides: Path, out: Path) -> dict:
    """Every deck in `slides` rendered to HTML by marp-cli and measured in headless Chromium:
    {deck name: [one dict per slide]} (see tests/slides_measure.js), and {deck name + ":html":
    marp's HTML}."""
    proc = subprocess.run([str(marp), "--no-stdin", "--html", "--template", "bare",
                           "--input-dir", str(slides), "--output", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (out / "figures").symlink_to(slides / "figures")  # the decks refer to figures/... relatively
    script = (Path(__file__).parent / "slides_measure.js").read_text()
    reports = {}
    for deck in sorted(slides.glob("*.md")):
        page = out / f"{deck.stem}.html"
        text = page.read_text()
        reports[deck.name + ":html"] = text
        measured = out / f"{deck.stem}.measured.html"
        # marp's own script only resizes wide code blocks, late: slides_measure.js does it at once
        text = re.sub(r"<script>.*?</script>", "", text, flags=re.S)
        measured.write_text(text.replace("</body>", inline_figures(text, slides)
                                         + f"<script>{script}</script></body>"))
        proc = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu",
                               "--hide-scrollbars", "--dump-dom",
                               measured.as_uri()],
                              capture_output=True, text=True, timeout=120)
        found = re.search(r'<pre id="overflow-report">(.*?)</pre>', proc.stdout, re.S)
        assert found, f"{deck.name}: Chromium returned no measurement: {proc.stderr[-2000:]}"
        reports[deck.name] = json.loads(html.unescape(found.group(1)))
    return reports


def inline_figures(page: str, slides: Path) -> str:
    """A hidden copy of every SVG the page shows, inline, so that slides_measure.js can measure
    its text as Chromium lays it out (an <img>'s SVG document is out of the page's reach)."""
    copies = []
    for src in sorted(set(re.findall(r'<img[^>]*\bsrc="(figures/[^"]+\.svg)"', page))):
        if (slides / src).is_file():
            svg = re.sub(r"<\?xml[^>]*\?>", "", (slides / src).read_text())
            copies.append(f'<div data-figure="{html.escape(src)}">{svg}</div>')
    return ('<div id="figure-copies" style="position:absolute; left:0; top:0; '
            f'visibility:hidden">{"".join(copies)}</div>')


@pytest.fixture(scope="session")
def rendered(tools, tmp_path_factory) -> dict[str, list[dict]]:
    """Every deck of slides/, rendered and measured (see render_and_measure)."""
    marp, chromium = tools
    return render_and_measure(marp, chromium, SLIDES, tmp_path_factory.mktemp("slides"))


def test_every_deck_renders_every_slide(rendered):
    for deck in decks():
        slides = len(re.findall(r"^---$", deck.read_text(), re.M)) - 1  # front matter: 2 rules
        assert len(rendered[deck.name]) == slides, f"{deck.name}: {len(rendered[deck.name])} " \
                                                   f"slides rendered, {slides} written"


def test_no_slide_runs_past_the_bottom_or_the_right_edge(rendered):
    problems = []
    for deck in decks():
        for s in rendered[deck.name]:
            if s["over_bottom"] > 1 or s["over_right"] > 1:
                problems.append(f"slides/{deck.name} slide {s['slide']}: {s['over_bottom']} px "
                                f"past the bottom, {s['over_right']} px past the right edge "
                                f"({s['what']})")
            elif s.get("room_bottom") is not None and s["room_bottom"] < ROOM_PX:
                problems.append(f"slides/{deck.name} slide {s['slide']}: only "
                                f"{s['room_bottom']} px to spare at the bottom "
                                f"({s['lowest_what']}), {ROOM_PX} needed: another browser "
                                "lays text out a few pixels differently; shorten it")
    assert not problems, "\n".join(problems)


def test_code_on_slides_stays_readable(rendered):
    small = [f"slides/{deck.name} slide {s['slide']}: code shrunk to {s['min_code_px']} px "
             f"(shorten its longest line)"
             for deck in decks() for s in rendered[deck.name]
             if s["min_code_px"] is not None and s["min_code_px"] < MIN_CODE_PX]
    assert not small, "\n".join(small)


def test_every_figure_loads(rendered):
    broken = [f"slides/{deck.name} slide {s['slide']}: {s['broken_images']}"
              for deck in decks() for s in rendered[deck.name] if s["broken_images"]]
    assert not broken, "\n".join(broken)


def test_no_rendered_bullet_has_a_hard_line_break(rendered):
    for deck in decks():
        items = re.findall(r"<li>(.*?)</li>", rendered[deck.name + ":html"], re.S)
        broken = [re.sub(r"<[^>]+>", "", i)[:60] for i in items if "<br" in i]
        assert not broken, f"slides/{deck.name}: line breaks inside bullets: {broken}"


def test_diagram_text_stays_readable(rendered):
    small = []
    for deck in decks():
        for s in rendered[deck.name]:
            for f in s["figures"]:
                where = f"slides/{deck.name} slide {s['slide']}: {f['src']}"
                if "error" in f:
                    small.append(f"{where}: {f['error']}")
                elif f.get("min_px") is not None and f["min_px"] < MIN_DIAGRAM_PX:
                    small.append(f"{where} shows its smallest text ({f['min_font_text']!r}, "
                                 f"font-size {f['min_font']} of {f['width']:g} wide) at "
                                 f"{f['min_px']} px (larger fonts in tools/figures.py, or show "
                                 "the figure larger)")
    assert not small, "\n".join(small)


def test_diagram_labels_fit_their_boxes_and_overlap_nothing(rendered):
    problems = [f"slides/{deck.name} slide {s['slide']}: {f['src']}: {problem}"
                for deck in decks() for s in rendered[deck.name] for f in s["figures"]
                for problem in f.get("problems", [])]
    assert not problems, "\n".join(problems)


BAD_FIGURE = """<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 640 360" width="640"
height="360">
<rect width="640" height="360" fill="white"/>
<rect x="150" y="20" width="100" height="40" fill="white" stroke="black"/>
<text x="200" y="45" font-size="20" text-anchor="middle">far too long for its box</text>
<text x="300" y="100" font-size="12">small</text>
<text x="300" y="200" font-size="24">one</text>
<text x="310" y="205" font-size="24">two</text>
<text x="630" y="300" font-size="24">off the edge</text>
<line x1="500" y1="0" x2="500" y2="150" stroke="black"/>
<text x="480" y="100" font-size="24">crossed</text>
<rect x="20" y="300" width="100" height="40" fill="white" stroke="black"/>
<text x="10" y="330" font-size="20">straddles</text>
<rect x="560" y="20" width="81" height="40" fill="white" stroke="black" stroke-width="2"/>
</svg>
"""


def test_the_diagram_measurement_finds_small_cramped_and_overlapping_labels(tools, tmp_path):
    slides = tmp_path / "slides"
    (slides / "figures").mkdir(parents=True)
    (slides / "figures" / "bad.svg").write_text(BAD_FIGURE)
    (slides / "deck.md").write_text("---\nmarp: true\n---\n\n![w:960](figures/bad.svg)\n\n"
                                    "---\n\n![h:180](figures/bad.svg)\n")
    report = render_and_measure(*tools, slides, tmp_path / "out")["deck.md"]
    large, small = (s["figures"][0] for s in report)
    assert (large["min_font"], large["min_font_text"]) == (12, "small")
    assert large["min_px"] == 18.0 and small["min_px"] == 6.0  # 12 x 960 / 640; 12 x 180 / 360
    expected = ['"far too long for its box" does not fit its box', '"one" overlaps "two"',
                '"off the edge" runs off the canvas', 'a line or arrow crosses "crossed"',
                '"straddles" crosses the border of a box', "a rect at (560, 20) runs off"]
    assert len(large["problems"]) == len(expected), large["problems"]
    for problem, words in zip(sorted(large["problems"]), sorted(expected), strict=True):
        assert problem.startswith(words), large["problems"]
