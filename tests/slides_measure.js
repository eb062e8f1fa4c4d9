// Injected into a deck rendered by marp-cli (bare template, with marp's own script removed),
// run by headless Chromium. For every slide: how far any element reaches past the slide's
// padding (bottom and right), the smallest code font, images that did not load, and for every
// SVG figure the size its smallest text is shown at and the labels that do not fit.
// The result goes into a pre element (id overflow-report) as JSON, read back from --dump-dom.
//
// marp shrinks a code block wider than the slide until it fits (its auto-scaling element, driven
// by ResizeObservers, so its timing varies). Here the same downscaling is done at once and
// deterministically: the code's font size times available width / natural width.
function shrinkWideCode() {
  document.querySelectorAll('pre').forEach(pre => {
    const code = pre.querySelector('code') || pre;
    const css = getComputedStyle(pre);
    const available = pre.clientWidth - parseFloat(css.paddingLeft) - parseFloat(css.paddingRight);
    const range = document.createRange();
    range.selectNodeContents(code);
    const section = pre.closest('section');
    const scale = section.getBoundingClientRect().width / section.offsetWidth;
    const natural = range.getBoundingClientRect().width / scale;
    if (natural > available && natural > 0) {
      const px = parseFloat(getComputedStyle(code).fontSize);
      code.style.fontSize = (px * available / natural) + 'px';
    }
  });
}

// A figure is an <img> of an SVG file; the test puts a copy of each file inline into the page
// (a div with data-figure="figures/x.svg", hidden), where Chromium lays out its text with the
// same fonts as in the image, so each label's box can be measured in the SVG's own units.
// An SVG image is scaled to fit its box (preserveAspectRatio "meet"): one SVG unit is shown at
// min(displayed width / viewBox width, displayed height / viewBox height) slide px.
const FIT_TOLERANCE = 1;  // SVG units a label may touch a border by (antialiasing, rounding)

function inside(b, r, tol) {
  return b.x >= r.x - tol && b.y >= r.y - tol && b.x + b.width <= r.x + r.width + tol &&
         b.y + b.height <= r.y + r.height + tol;
}

function intersects(a, b, tol) {
  return a.x + a.width > b.x + tol && b.x + b.width > a.x + tol &&
         a.y + a.height > b.y + tol && b.y + b.height > a.y + tol;
}

function segmentCrosses(box, x1, y1, x2, y2, tol) {
  // does the segment pass through the box shrunk by tol? (Liang-Barsky clipping)
  const xmin = box.x + tol, xmax = box.x + box.width - tol;
  const ymin = box.y + tol, ymax = box.y + box.height - tol;
  if (xmin >= xmax || ymin >= ymax) return false;
  let t0 = 0, t1 = 1;
  const dx = x2 - x1, dy = y2 - y1;
  for (const [p, q] of [[-dx, x1 - xmin], [dx, xmax - x1], [-dy, y1 - ymin], [dy, ymax - y1]]) {
    if (p === 0) { if (q < 0) return false; continue; }
    const t = q / p;
    if (p < 0) { if (t > t1) return false; if (t > t0) t0 = t; }
    else { if (t < t0) return false; if (t < t1) t1 = t; }
  }
  return t0 < t1;
}

function measureFigure(src) {
  const holder = document.querySelector(`div[data-figure="${CSS.escape(src)}"]`);
  const svg = holder && holder.querySelector('svg');
  if (!svg) return {error: `no inline copy of ${src} in the page`};
  const vb = svg.viewBox.baseVal;
  const label = t => '"' + t.textContent.trim().slice(0, 40) + '"';
  const round = v => Math.round(v * 10) / 10;
  const texts = [...svg.querySelectorAll('text')].map(t => ({
    el: t, box: t.getBBox(), size: parseFloat(getComputedStyle(t).fontSize),
    x: t.x.baseVal.length ? t.x.baseVal[0].value : 0,
    y: t.y.baseVal.length ? t.y.baseVal[0].value : 0}));
  const canvas = {x: vb.x, y: vb.y, width: vb.width, height: vb.height};
  // the background (a rect as large as the canvas) is no label's box
  const rects = [...svg.querySelectorAll('rect')].map(r => r.getBBox())
    .filter(r => !(r.width >= vb.width && r.height >= vb.height));
  const lines = [...svg.querySelectorAll('line')].map(l => [l.x1, l.y1, l.x2, l.y2]
    .map(a => a.baseVal.value));
  const problems = [];
  // a shape past the canvas is cut off where the image ends (half its stroke lies outside)
  svg.querySelectorAll('rect, line').forEach(el => {
    const b = el.getBBox(), half = (parseFloat(el.getAttribute('stroke-width')) || 0) / 2;
    const outer = {x: b.x - half, y: b.y - half, width: b.width + 2 * half,
                   height: b.height + 2 * half};
    if (!inside(outer, canvas, FIT_TOLERANCE))
      problems.push(`a ${el.tagName} at (${round(b.x)}, ${round(b.y)}) runs off the canvas`);
  });
  let smallest = null;
  texts.forEach((t, i) => {
    if (!t.el.textContent.trim()) return;
    if (smallest === null || t.size < smallest.size) smallest = t;
    const box = t.box;
    if (!inside(box, canvas, FIT_TOLERANCE))
      problems.push(`${label(t.el)} runs off the canvas`);
    // its box: the smallest rect around the label's anchor point; it must hold all of the label,
    // and the label must not cross the border of any other rect (half in, half out)
    const around = rects.filter(r => t.x >= r.x && t.x <= r.x + r.width &&
                                     t.y >= r.y && t.y <= r.y + r.height);
    around.sort((a, b) => a.width * a.height - b.width * b.height);
    const own = around[0];
    if (own && !inside(box, own, FIT_TOLERANCE))
      problems.push(`${label(t.el)} does not fit its box (${round(box.width)} x ` +
                    `${round(box.height)} in ${round(own.width)} x ${round(own.height)})`);
    else if (rects.some(r => intersects(box, r, FIT_TOLERANCE) && !inside(box, r, FIT_TOLERANCE)))
      problems.push(`${label(t.el)} crosses the border of a box`);
    texts.slice(i + 1).forEach(o => {
      if (o.el.textContent.trim() && intersects(box, o.box, FIT_TOLERANCE))
        problems.push(`${label(t.el)} overlaps ${label(o.el)}`);
    });
    if (lines.some(([x1, y1, x2, y2]) => segmentCrosses(box, x1, y1, x2, y2, FIT_TOLERANCE)))
      problems.push(`a line or arrow crosses ${label(t.el)}`);
  });
  return {width: vb.width, height: vb.height, min_font: smallest && round(smallest.size),
          min_font_text: smallest && smallest.el.textContent.trim().slice(0, 40), problems};
}

function measure() {
  shrinkWideCode();
  const report = [];
  document.querySelectorAll('svg > foreignObject > section').forEach((section, i) => {
    const box = section.getBoundingClientRect();
    const scale = box.width / section.offsetWidth;  // the page may scale the 1280 px slide
    const css = getComputedStyle(section);
    const bottom = box.bottom - parseFloat(css.paddingBottom) * scale;
    const right = box.right - parseFloat(css.paddingRight) * scale;
    const slide = {slide: i + 1, over_bottom: 0, over_right: 0, what: '', min_code_px: null,
                   broken_images: [], figures: [], lowest: -Infinity, lowest_what: ''};
    section.querySelectorAll('*').forEach(el => {
      const r = el.getBoundingClientRect();
      if (r.width === 0 && r.height === 0) return;
      const below = (r.bottom - bottom) / scale, beside = (r.right - right) / scale;
      const name = el.tagName.toLowerCase() + ' "' + el.textContent.trim().slice(0, 50) + '"';
      if (below > slide.over_bottom) { slide.over_bottom = below; slide.what = name; }
      // the lowest text of the slide's content (not marp's page number; an image's size does
      // not depend on the fonts, and the check above holds it inside the slide)
      if (below > slide.lowest && !el.closest('header, footer') && el.textContent.trim()) {
        slide.lowest = below; slide.lowest_what = name;
      }
      if (beside > slide.over_right) { slide.over_right = beside; slide.what = name; }
      if (el.tagName === 'CODE' && el.closest('pre')) {
        const px = parseFloat(getComputedStyle(el).fontSize);
        if (slide.min_code_px === null || px < slide.min_code_px) slide.min_code_px = px;
      }
      if (el.tagName === 'IMG' && !(el.complete && el.naturalWidth > 0))
        slide.broken_images.push(el.getAttribute('src'));
      else if (el.tagName === 'IMG' && /\.svg$/i.test(el.getAttribute('src'))) {
        const fig = measureFigure(el.getAttribute('src'));
        fig.src = el.getAttribute('src');
        fig.shown_width = Math.round(r.width / scale * 10) / 10;
        fig.shown_height = Math.round(r.height / scale * 10) / 10;
        if (fig.min_font !== null && fig.min_font !== undefined) {
          const unit = Math.min(r.width / scale / fig.width, r.height / scale / fig.height);
          fig.min_px = Math.round(fig.min_font * unit * 10) / 10;
        }
        slide.figures.push(fig);
      }
    });
    slide.over_bottom = Math.round(slide.over_bottom);
    // px between the lowest content and the bottom padding (negative: past it)
    slide.room_bottom = slide.lowest === -Infinity ? null : Math.round(-slide.lowest);
    slide.over_right = Math.round(slide.over_right);
    if (slide.min_code_px !== null) slide.min_code_px = Math.round(slide.min_code_px * 10) / 10;
    report.push(slide);
  });
  const pre = document.createElement('pre');
  pre.id = 'overflow-report';
  pre.textContent = JSON.stringify(report);
  document.body.appendChild(pre);
}

window.addEventListener('load', measure);
