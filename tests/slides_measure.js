// Injected into a deck rendered by marp-cli (bare template, with marp's own script removed),
// run by headless Chromium. For every slide: how far any element reaches past the slide's
// padding (bottom and right), the smallest code font, and images that did not load.
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
                   broken_images: []};
    section.querySelectorAll('*').forEach(el => {
      const r = el.getBoundingClientRect();
      if (r.width === 0 && r.height === 0) return;
      const below = (r.bottom - bottom) / scale, beside = (r.right - right) / scale;
      const name = el.tagName.toLowerCase() + ' "' + el.textContent.trim().slice(0, 50) + '"';
      if (below > slide.over_bottom) { slide.over_bottom = below; slide.what = name; }
      if (beside > slide.over_right) { slide.over_right = beside; slide.what = name; }
      if (el.tagName === 'CODE' && el.closest('pre')) {
        const px = parseFloat(getComputedStyle(el).fontSize);
        if (slide.min_code_px === null || px < slide.min_code_px) slide.min_code_px = px;
      }
      if (el.tagName === 'IMG' && !(el.complete && el.naturalWidth > 0))
        slide.broken_images.push(el.getAttribute('src'));
    });
    slide.over_bottom = Math.round(slide.over_bottom);
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
