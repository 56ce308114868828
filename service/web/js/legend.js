// Beside the result: the legend (label names and colours, or the colour ramp), the run's plan and
// seam figures from the result's X-Tilewise-* headers, and the download link.

import { drawRamp, labelCss, RAMP_THRESHOLD } from "./palette.js";

function element(tag, props = {}, children = []) {
  const node = document.createElement(tag);
  Object.assign(node, props);
  for (const child of children) node.append(child);
  return node;
}

/** "tile=96,96,96; halo=8,8,8; tiles=27" as [["tile", "96,96,96"], ...]. */
export function parsePairs(text) {
  if (!text) return [];
  return text
    .split(";")
    .map((part) => part.trim())
    .filter((part) => part.includes("="))
    .map((part) => [part.slice(0, part.indexOf("=")).trim(), part.slice(part.indexOf("=") + 1).trim()]);
}

function share(count, total) {
  const percent = (100 * count) / total;
  return percent > 0 && percent < 0.1 ? "<0.1 %" : `${percent.toFixed(1)} %`;
}

/** Fill the legend list for a labels output (names from the model) or a probability output. */
export function showLegend(list, facts, meta) {
  list.replaceChildren();
  if (meta.kind === "labels") {
    const counts = new Map();
    for (const v of facts.values) counts.set(v, (counts.get(v) || 0) + 1);
    const ids = new Set([...Object.keys(meta.labels || {}).map(Number), ...counts.keys()]);
    for (const id of [...ids].sort((a, b) => a - b)) {
      const name = (meta.labels || {})[id] ?? `label ${id}`;
      const swatch = element("span", { className: id === 0 ? "swatch none" : "swatch" });
      if (id !== 0) swatch.style.background = labelCss(id);
      const text = `${name} (${id})${id === 0 ? ", not drawn" : ""}: ${share(counts.get(id) || 0, facts.values.length)}`;
      const item = element("li", {}, [swatch, element("span", { textContent: text })]);
      item.dataset.label = String(id);
      list.append(item);
    }
    return;
  }
  const [lo, hi] = facts.range;
  const ramp = element("canvas", { className: "ramp", role: "img", ariaLabel: "colour ramp, dark red to yellow" });
  drawRamp(ramp);
  const cut = lo + RAMP_THRESHOLD * (hi - lo);
  list.append(
    element("li", {}, [ramp]),
    element("li", { textContent: `${fmt(lo)} … ${fmt(hi)}; below ${fmt(cut)} not drawn` }),
  );
}

/** The legend of a slide's overlay: label names and colours (no counts: the output is not in
 * the page), or the ramp over the range the server draws (X-Tilewise-Range). */
export function showSlideLegend(list, facts, meta) {
  if (meta.kind !== "labels") {
    showLegend(list, { range: facts.range }, meta);
    return;
  }
  list.replaceChildren();
  const ids = Object.keys(meta.labels || {}).map(Number).sort((a, b) => a - b);
  for (const id of ids.length ? ids : [0, 1]) {
    const name = (meta.labels || {})[id] ?? `label ${id}`;
    const swatch = element("span", { className: id === 0 ? "swatch none" : "swatch" });
    if (id !== 0) swatch.style.background = labelCss(id);
    const item = element("li", {}, [swatch, element("span", { textContent: `${name} (${id})${id === 0 ? ", not drawn" : ""}` })]);
    item.dataset.label = String(id);
    list.append(item);
  }
}

function fmt(value) {
  return Math.abs(value) >= 100 || value === 0 ? value.toFixed(0) : value.toPrecision(3);
}

/** Fill the facts list from the result headers and the job's status. */
export function showFacts(list, headers, job) {
  list.replaceChildren();
  const add = (term, value, warn = false) => {
    list.append(element("dt", { textContent: term }), element("dd", { textContent: value, className: warn ? "warn" : "" }));
  };
  add("model", headers.get("x-tilewise-model") || job.model);
  add("output", `${headers.get("x-tilewise-output") || "?"}, ${headers.get("x-tilewise-format") || "?"}`);
  const shape = headers.get("x-tilewise-shape");
  if (shape) add("shape", shape);
  for (const [key, value] of parsePairs(headers.get("x-tilewise-plan"))) add(key, value);
  const seam = parsePairs(headers.get("x-tilewise-seam"));
  for (const [key, value] of seam) add(`seam ${key}`, value);
  if (seam.length === 0) add("seam", "none: tiles are exact (the halo covers the receptive field)");
  const warning = headers.get("x-tilewise-warning");
  if (warning) add("warning", warning, true);
  if (job.started && job.finished) {
    const seconds = (Date.parse(job.finished) - Date.parse(job.started)) / 1000;
    add("run time", `${seconds.toFixed(1)} s`);
  }
  add("job", job.id);
}

/** Point the download link at the result's bytes. */
export function showDownload(link, result) {
  if (link.href.startsWith("blob:")) URL.revokeObjectURL(link.href);
  link.href = URL.createObjectURL(new Blob([result.bytes], { type: result.type }));
  link.download = result.filename;
  link.textContent = `Download ${result.filename}`;
  link.hidden = false;
}
