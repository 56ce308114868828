// 2D images: the input drawn on a canvas at its own size (one canvas pixel per image pixel), the
// output blended over it in the same colours as the volume views. The composite is computed here,
// pixel by pixel, so what the canvas holds is exactly the picture and the overlay.

import { LABEL_PALETTE, RAMP, RAMP_THRESHOLD } from "./palette.js";

/** The picture of a decoded image ({width, height, channels, planes}) as RGBA bytes, contrast
 * stretched over its own range (a 16-bit or float image shows as a grey picture). */
export function pictureOf(image) {
  const { width, height, channels, planes } = image;
  const n = width * height;
  const rgba = new Uint8ClampedArray(4 * n);
  const shown = channels >= 3 ? [0, 1, 2] : [0, 0, 0];
  let lo = Infinity;
  let hi = -Infinity;
  for (const c of new Set(shown)) {
    for (const v of planes[c]) {
      if (v < lo) lo = v;
      if (v > hi) hi = v;
    }
  }
  const scale = hi > lo ? 255 / (hi - lo) : 0;
  for (let k = 0; k < n; k++) {
    for (let s = 0; s < 3; s++) rgba[4 * k + s] = (planes[shown[s]][k] - lo) * scale;
    rgba[4 * k + 3] = 255;
  }
  return { width, height, rgba };
}

export class ImageView {
  constructor(canvas, onLocation) {
    this.canvas = canvas;
    this.onLocation = onLocation;
    this.picture = null;
    this.output = null;
    this.opacity = 0.6;
    this.channel = 0;
    canvas.addEventListener("click", (event) => this.probe(event));
  }

  /**
   * Show a picture ({width, height, rgba}) and an output ({width, height, channels, planes}).
   * @returns {{values, channels, maxId, range, voxels}} facts about the output for the legend.
   */
  show(picture, output, meta) {
    this.picture = picture;
    this.output = output;
    this.kind = meta.kind;
    this.labels = meta.labels || {};
    this.opacity = meta.opacity;
    this.channel = meta.channel || 0;
    this.canvas.width = picture.width;
    this.canvas.height = picture.height;
    const facts = { values: output.planes[0], channels: output.channels, voxels: output.width * output.height };
    if (meta.kind === "labels") {
      let maxId = 0;
      for (const v of output.planes[0]) if (v > maxId) maxId = v;
      facts.maxId = maxId;
    } else {
      let lo = Infinity;
      let hi = -Infinity;
      for (const plane of output.planes) {
        for (const v of plane) {
          if (v < lo) lo = v;
          if (v > hi) hi = v;
        }
      }
      lo = Math.min(lo, 0);
      this.range = [lo, hi > lo ? hi : lo + 1];
      facts.range = this.range;
    }
    this.draw();
    return facts;
  }

  /** Show the input picture alone (as soon as it is chosen; the output comes over it later). */
  showInput(picture) {
    this.picture = picture;
    this.output = null;
    this.canvas.width = picture.width;
    this.canvas.height = picture.height;
    this.draw();
  }

  setOpacity(value) {
    this.opacity = value;
    this.draw();
  }

  setChannel(index) {
    this.channel = index;
    this.draw();
  }

  /** The output's value under picture pixel (x, y) (nearest, for outputs of another size). */
  valueAt(x, y) {
    const out = this.output;
    const ox = Math.min(out.width - 1, Math.floor((x * out.width) / this.picture.width));
    const oy = Math.min(out.height - 1, Math.floor((y * out.height) / this.picture.height));
    return out.planes[this.kind === "labels" ? 0 : this.channel][oy * out.width + ox];
  }

  draw() {
    if (!this.picture) return;
    const { width, height, rgba } = this.picture;
    const image = new ImageData(new Uint8ClampedArray(rgba), width, height);
    const data = image.data;
    const alpha = this.opacity;
    const [lo, hi] = this.range || [0, 1];
    for (let y = 0; this.output && y < height; y++) {
      for (let x = 0; x < width; x++) {
        const v = this.valueAt(x, y);
        let colour = null;
        if (this.kind === "labels") {
          if (v !== 0) colour = LABEL_PALETTE[v % 256];
        } else {
          const t = (v - lo) / (hi - lo);
          if (t >= RAMP_THRESHOLD) colour = RAMP[Math.min(255, Math.max(0, Math.round(t * 255)))];
        }
        if (colour === null) continue;
        const k = 4 * (y * width + x);
        for (let s = 0; s < 3; s++) data[k + s] = data[k + s] * (1 - alpha) + colour[s] * alpha;
      }
    }
    this.canvas.getContext("2d").putImageData(image, 0, 0);
  }

  probe(event) {
    if (!this.picture || !this.output) return;
    const box = this.canvas.getBoundingClientRect();
    const x = Math.floor(((event.clientX - box.left) * this.picture.width) / box.width);
    const y = Math.floor(((event.clientY - box.top) * this.picture.height) / box.height);
    if (x < 0 || y < 0 || x >= this.picture.width || y >= this.picture.height) return;
    const v = this.valueAt(x, y);
    const what = this.kind === "labels" ? `${this.labels[v] ?? `label ${v}`} (${v})` : Number(v).toPrecision(4);
    this.onLocation(`Pixel x ${x}, y ${y}: output ${what}`);
  }
}
