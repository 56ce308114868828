// Volumes: NiiVue's three orthogonal slice views (axial, coronal, sagittal) of the input, with the
// output as an overlay (labels in the label colours, probabilities on the colour ramp); one
// crosshair moves all three. NiiVue is the UMD bundle served from /static/vendor/ (window.niivue).

import { LABEL_PALETTE, RAMP, RAMP_THRESHOLD } from "./palette.js";

const RAMP_NAME = "tilewise-ramp";

/** Is the viewer's script loaded (installed on the server, and WebGL 2 usable)? */
export function viewerProblem() {
  if (typeof window.niivue === "undefined" || !window.niivue.Niivue) {
    return "The volume viewer (NiiVue) is not installed on this server: run `tilewise setup-web` (or `tilewise setup-models`) and reload.";
  }
  const probe = document.createElement("canvas").getContext("webgl2");
  if (!probe) return "This browser has no WebGL 2, which the volume viewer needs.";
  return null;
}

function niftiName(bytes, base) {
  const head = new Uint8Array(bytes, 0, 2);
  return head[0] === 0x1f && head[1] === 0x8b ? `${base}.nii.gz` : `${base}.nii`;
}

function labelColormap(names, maxId) {
  const cm = { R: [], G: [], B: [], A: [], I: [], labels: [] };
  for (let id = 0; id <= maxId; id++) {
    const [r, g, b] = LABEL_PALETTE[id % 256];
    cm.R.push(r);
    cm.G.push(g);
    cm.B.push(b);
    cm.A.push(id === 0 ? 0 : 255);
    cm.I.push(id);
    cm.labels.push(names[id] ?? `label ${id}`);
  }
  return cm;
}

function rampColormap() {
  const pick = [0, 64, 128, 192, 255];
  return {
    R: pick.map((k) => RAMP[k][0]),
    G: pick.map((k) => RAMP[k][1]),
    B: pick.map((k) => RAMP[k][2]),
    A: pick.map((k) => (k === 0 ? 0 : 255)),
    I: pick,
  };
}

export class VolumeView {
  constructor(canvas, box, onLocation) {
    this.canvas = canvas;
    this.box = box;
    this.onLocation = onLocation;
    this.nv = null;
    this.output = null;
    box.addEventListener("keydown", (event) => this.key(event));
  }

  async ensure() {
    if (this.nv) return this.nv;
    const nv = new window.niivue.Niivue({
      backColor: [0, 0, 0, 1],
      crosshairColor: [0.15, 0.85, 1, 1],
      show3Dcrosshair: false,
      isColorbar: false,
      dragAndDropEnabled: false,
      logLevel: "error",
      isResizeCanvas: true,
      multiplanarShowRender: window.niivue.SHOW_RENDER.NEVER, // three slice views, no 3D render
    });
    await nv.attachToCanvas(this.canvas);
    nv.addColormap(RAMP_NAME, rampColormap());
    nv.onLocationChange = (data) => this.located(data);
    this.nv = nv;
    return nv;
  }

  /**
   * Show the input volume and the output over it.
   * @param input ArrayBuffer of the NIfTI input; result: {bytes} of the NIfTI output;
   * @param meta {kind: "labels"|"probabilities", labels: {id: name}, opacity: 0..1}
   * @returns {{values, maxId, channels, range}} facts about the output for the legend.
   */
  async show(input, result, meta) {
    const nv = await this.ensure();
    const { NVImage } = window.niivue;
    while (nv.volumes.length > 0) nv.removeVolume(nv.volumes[nv.volumes.length - 1]);
    const base = await NVImage.loadFromUrl({ url: input, name: niftiName(input, "input"), colormap: "gray" });
    const over = await NVImage.loadFromUrl({ url: result.bytes, name: niftiName(result.bytes, "output") });
    nv.addVolume(base);
    nv.addVolume(over);
    const channels = over.nFrame4D || 1;
    const facts = { values: over.img, channels, voxels: over.img.length / channels };
    if (meta.kind === "labels") {
      let maxId = 0;
      for (const v of over.img) if (v > maxId) maxId = v;
      over.setColormapLabel(labelColormap(meta.labels || {}, Math.max(maxId, ...Object.keys(meta.labels || {}).map(Number))));
      facts.maxId = maxId;
    } else {
      let lo = Infinity;
      let hi = -Infinity;
      for (const v of over.img) {
        if (v < lo) lo = v;
        if (v > hi) hi = v;
      }
      lo = Math.min(lo, 0);
      if (hi <= lo) hi = lo + 1;
      over.colormap = RAMP_NAME;
      over.cal_min = lo + RAMP_THRESHOLD * (hi - lo);
      over.cal_max = hi;
      facts.range = [lo, hi];
    }
    over.opacity = meta.opacity;
    // Labels are ids, never blended: nearest-neighbour sampling (a slice between two voxel planes
    // would otherwise mix their colours). Probabilities and the input stay smooth.
    nv.setInterpolation(meta.kind === "labels");
    // A one-slice NIfTI (a 2D image for a 2D model) has one view worth showing.
    const flat = base.hdr.dims[3] <= 1;
    nv.setSliceType(flat ? nv.sliceTypeAxial : nv.sliceTypeMultiplanar);
    nv.updateGLVolume();
    this.output = over;
    this.kind = meta.kind;
    this.labels = meta.labels || {};
    return facts;
  }

  /** Show the input volume alone (as soon as it is chosen; the output comes over it later). */
  async showInput(input) {
    const nv = await this.ensure();
    const { NVImage } = window.niivue;
    while (nv.volumes.length > 0) nv.removeVolume(nv.volumes[nv.volumes.length - 1]);
    const base = await NVImage.loadFromUrl({ url: input, name: niftiName(input, "input"), colormap: "gray" });
    nv.addVolume(base);
    nv.setSliceType(base.hdr.dims[3] <= 1 ? nv.sliceTypeAxial : nv.sliceTypeMultiplanar);
    nv.updateGLVolume();
    this.output = null;
  }

  setOpacity(value) {
    if (this.nv && this.nv.volumes.length > 1) this.nv.setOpacity(1, value);
  }

  setChannel(index) {
    if (this.output) this.nv.setFrame4D(this.output.id, index);
  }

  located(data) {
    if (!data || !data.vox) return;
    const values = data.values || [];
    const input = values[0] ? values[0].value : NaN;
    const output = values[1] ? values[1].value : NaN;
    const mm = Array.from(data.mm.slice(0, 3), (v) => v.toFixed(1)).join(", ");
    let text = `Crosshair at ${mm} mm (voxel ${data.vox.join(", ")}): input ${format(input)}`;
    if (this.kind === "labels") {
      const id = Math.round(output);
      text += `, output ${this.labels[id] ?? `label ${id}`} (${id})`;
    } else {
      text += `, output ${format(output)}`;
    }
    this.onLocation(text);
  }

  key(event) {
    if (!this.nv || this.nv.volumes.length === 0) return;
    const moves = {
      ArrowLeft: [-1, 0, 0],
      ArrowRight: [1, 0, 0],
      ArrowDown: [0, -1, 0],
      ArrowUp: [0, 1, 0],
      PageDown: [0, 0, -1],
      PageUp: [0, 0, 1],
    };
    const move = moves[event.key];
    if (!move) return;
    event.preventDefault();
    this.nv.moveCrosshairInVox(...move);
  }
}

function format(value) {
  if (!Number.isFinite(value)) return "–";
  return Math.abs(value) >= 1000 || Number.isInteger(value) ? String(Math.round(value)) : value.toPrecision(4);
}
