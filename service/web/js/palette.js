// Colours of the overlay: one per label id (the server's LABEL_PALETTE, so a downloaded label
// PNG shows the same colours), and one colour ramp for probabilities.

function roundHalfEven(x) {
  // Python's round(): ties go to the even neighbour.
  const r = Math.round(x);
  return Math.abs(x % 1) === 0.5 ? 2 * Math.round(x / 2) : r;
}

function hsvToRgb(h, s, v) {
  // colorsys.hsv_to_rgb, operation for operation (same floating-point results).
  const i = Math.trunc(h * 6.0);
  const f = h * 6.0 - i;
  const p = v * (1.0 - s);
  const q = v * (1.0 - s * f);
  const t = v * (1.0 - s * (1.0 - f));
  return [[v, t, p], [q, v, p], [p, v, t], [p, q, v], [t, p, v], [v, p, q]][i % 6];
}

function buildPalette() {
  // service.codecs.image_encode._label_palette: 0 black, 1..7 Okabe and Ito's colour-blind-safe
  // set (orange, sky blue, bluish green, yellow, blue, vermillion, reddish purple), then hues a
  // golden angle apart at three brightness levels.
  const colours = [
    [0, 0, 0], [230, 159, 0], [86, 180, 233], [0, 158, 115], [240, 228, 66], [0, 114, 178], [213, 94, 0], [204, 121, 167],
  ];
  const seen = new Set(colours.map((c) => c.join(",")));
  let i = 0;
  while (colours.length < 256) {
    i += 1;
    const hue = (i * 0.618033988749895) % 1.0;
    const value = [1.0, 0.75, 0.5][i % 3];
    const rgb = hsvToRgb(hue, 0.85, value).map((c) => roundHalfEven(c * 255));
    const key = rgb.join(",");
    if (!seen.has(key)) {
      seen.add(key);
      colours.push(rgb);
    }
  }
  return colours;
}

/** RGB of each label id 0..255 (index = id). */
export const LABEL_PALETTE = buildPalette();

/** The probability ramp: dark red, orange, yellow (256 RGB entries). */
export const RAMP = (() => {
  const stops = [[0, [150, 0, 0]], [0.5, [255, 96, 0]], [1, [255, 255, 0]]];
  const out = [];
  for (let k = 0; k < 256; k++) {
    const t = k / 255;
    let j = 0;
    while (j < stops.length - 2 && t > stops[j + 1][0]) j++;
    const [t0, c0] = stops[j];
    const [t1, c1] = stops[j + 1];
    const u = (t - t0) / (t1 - t0);
    out.push(c0.map((c, n) => Math.round(c + (c1[n] - c) * u)));
  }
  return out;
})();

/** Share of the value range below which probabilities are not drawn. */
export const RAMP_THRESHOLD = 0.1;

/** A CSS colour of a label id. */
export function labelCss(id) {
  const [r, g, b] = LABEL_PALETTE[id % 256];
  return `rgb(${r}, ${g}, ${b})`;
}

/** Draw the probability ramp into a canvas (for the legend). */
export function drawRamp(canvas) {
  canvas.width = 256;
  canvas.height = 1;
  const context = canvas.getContext("2d");
  const image = context.createImageData(256, 1);
  RAMP.forEach(([r, g, b], k) => image.data.set([r, g, b, 255], 4 * k));
  context.putImageData(image, 0, 0);
}
