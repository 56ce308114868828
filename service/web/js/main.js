// The page's flow: API key (when the server needs one) → models → file and options → job →
// progress from the event stream (cancel) → result over the input, legend, plan, download.

import { Api, ApiError } from "./api.js";
import { pictureOfFile, sniff, valuesOfFile } from "./decode/files.js";
import { RunForm } from "./form.js";
import { showDownload, showFacts, showLegend, showSlideLegend } from "./legend.js";
import { SLIDE_EDGE, SlideView, slidesAvailable } from "./slides.js";
import { ImageView, pictureOf } from "./view2d.js";
import { VolumeView, viewerProblem } from "./view3d.js";

const $ = (id) => document.getElementById(id);
const meta = (name) => document.querySelector(`meta[name="${name}"]`).content;

const api = new Api();
const state = { job: null, running: false, abort: null };
const ui = {
  run: $("run"),
  cancel: $("cancel"),
  progress: $("progress"),
  percent: $("percent"),
  status: $("status"),
  error: $("error"),
  result: $("result"),
  opacity: $("opacity"),
  opacityValue: $("opacity-value"),
  channel: $("channel"),
  channelBox: $("channel-box"),
  location: $("location"),
};
const form = new RunForm(() => {
  updateButtons();
  if (form.file !== shownInput) showInput(form.file);
});
let shownInput = null;
const showLocation = (text) => {
  ui.location.textContent = text;
};
const volumes = new VolumeView($("view3d"), $("canvas-box"), showLocation);
const images = new ImageView($("view2d"), showLocation);
const slides = new SlideView($("slide"), api);
let view = null;
// The viewers, for scripting the page from the browser's console (and for its tests).
window.tilewise = { volumes, images, slides };

function updateButtons() {
  ui.run.disabled = state.running || !form.ready();
  ui.cancel.disabled = !state.running;
}

function say(text) {
  ui.status.textContent = text;
}

function fail(error) {
  ui.error.hidden = false;
  ui.error.textContent = error instanceof ApiError ? `The server answered ${error.status}: ${error.message}` : String(error.message || error);
  // With the options open the message can lie below the fold (1280x800): bring it into view.
  const box = ui.error.getBoundingClientRect();
  if (box.bottom > window.innerHeight || box.top < 0) ui.error.scrollIntoView({ block: "nearest" });
}

/** The chosen file in the viewer at once, before any run (a volume job can take a minute). */
async function showInput(file) {
  shownInput = file;
  if (!file || state.running) return;
  try {
    const input = await file.arrayBuffer();
    if (shownInput !== file) return; // another file was chosen meanwhile
    const type = sniff(input);
    $("canvas-box").classList.toggle("volume", type === "nifti");
    $("canvas-box").classList.toggle("image", type !== "nifti");
    $("legend").replaceChildren();
    $("facts").replaceChildren();
    $("download").hidden = true;
    ui.channelBox.hidden = true;
    if (type === "nifti") {
      if (viewerProblem()) return;
      $("view2d").hidden = true;
      $("view3d").hidden = false;
      ui.result.hidden = false;
      view = volumes;
      await volumes.showInput(input);
    } else {
      $("view3d").hidden = true;
      $("view2d").hidden = false;
      ui.result.hidden = false;
      view = images;
      images.showInput(await pictureOfFile(input, type, pictureOf));
    }
    ui.location.textContent = `The input, ${file.name}; the output will be drawn over it.`;
  } catch (error) {
    // not an image the page can draw: the server will say what it is when it runs
    ui.location.textContent = "";
  }
}

function clearError() {
  ui.error.hidden = true;
  ui.error.textContent = "";
}

function setProgress(fraction) {
  ui.progress.value = fraction;
  ui.percent.textContent = `${Math.floor(100 * fraction)} %`;
}

function progressText(job) {
  const parts = [job.state];
  if (job.tiles_total) parts.push(`${job.tiles_done} / ${job.tiles_total} tiles`);
  if (job.tiles_skipped) parts.push(`${job.tiles_skipped} skipped`); // background: counted as done
  if (job.state === "running" && job.eta_s !== null && job.eta_s !== undefined) parts.push(`ETA ${Math.ceil(job.eta_s)} s`);
  return parts.join(" · ");
}

async function loadModels() {
  clearError();
  say("Loading models…");
  try {
    form.setModels(await api.models());
    say(form.models.length ? "Choose a model and a file." : "This server has no models.");
    return true;
  } catch (error) {
    fail(error);
    say(error.status === 401 ? "The API key was refused." : "The models could not be listed.");
    return false;
  }
}

async function run() {
  const model = form.model();
  const file = form.file;
  state.running = true;
  state.job = null;
  state.abort = new AbortController();
  updateButtons();
  clearError();
  setProgress(0);
  if (shownInput !== file) ui.result.hidden = true; // the input stays in view while the job runs
  try {
    say(`Uploading ${file.name}…`);
    const job = await api.submit(model.name, form.params(), file);
    state.job = job;
    say(progressText(job));
    let last = job;
    const end = await follow(job.id, (status) => {
      last = status;
      setProgress(status.progress);
      say(progressText(status));
    });
    if (end === "done") {
      say("done · loading the result…");
      await showResult(model, file, last);
      setProgress(1);
      say(`done · ${progressText(last).replace(/^done · /, "")}`);
      // One column (a phone): bring the result into view when it lies below the screen.
      if (ui.result.getBoundingClientRect().top > window.innerHeight) ui.result.scrollIntoView({ block: "start" });
    } else if (end === "failed") {
      const error = last.error || {};
      fail(new ApiError(0, error.error || "failed", error.detail || ""));
      say("failed");
    } else {
      say("cancelled");
    }
  } catch (error) {
    if (error.name === "AbortError") {
      say("cancelled");
    } else {
      fail(error);
      say(state.job ? `${state.job.state} · stopped following the job` : "not submitted");
    }
  } finally {
    state.running = false;
    state.abort = null;
    updateButtons();
  }
}

/** The job's events until its end; a stream cut short (a proxy, a restarted replica) is opened
 * again, up to five times in a row, since any replica answers for any job. */
async function follow(id, onStatus) {
  for (let failures = 0; ; ) {
    try {
      return await api.follow(id, (name, status) => onStatus(status), state.abort.signal);
    } catch (error) {
      const retry = error.name === "TypeError" || (error instanceof ApiError && error.code === "stream_ended");
      if (!retry || ++failures > 5) throw error;
      say(`${ui.status.textContent.split(" · reconnecting")[0]} · reconnecting…`);
      await new Promise((resolve) => setTimeout(resolve, 1000));
    }
  }
}

async function cancel() {
  ui.cancel.disabled = true;
  if (!state.job) {
    if (state.abort) state.abort.abort(); // still uploading: no job yet
    return;
  }
  say("cancelling…");
  try {
    await api.cancel(state.job.id); // the event stream then ends with "cancelled"
  } catch (error) {
    fail(error);
  }
}

/** A slide or a large 2D image (a TIFF past SLIDE_EDGE a side): drawn from deep-zoom tiles. */
async function isSlide(job, type) {
  if (type !== "tiff" || !slidesAvailable()) return false;
  try {
    const { width, height } = await slides.descriptor(job.id, "input");
    return Math.max(width, height) > SLIDE_EDGE;
  } catch (error) {
    return false; // no view of this input: the page's own canvas
  }
}

async function showSlide(model, job) {
  const answer = await api.request("GET", `/v1/jobs/${encodeURIComponent(job.id)}/result`);
  answer.body.cancel(); // the headers only: a slide's output is not read into the page
  const kind = answer.headers.get("x-tilewise-output") || (model.defaults || {}).output || "probabilities";
  const channel = firstChannel(kind, model);
  const info = { kind, labels: model.labels || {}, opacity: ui.opacity.value / 100, channel };
  showFacts($("facts"), answer.headers, job);
  const link = $("download");
  link.hidden = Boolean(api.key); // a link cannot send the key: the API serves the file
  link.href = `/v1/jobs/${encodeURIComponent(job.id)}/result`;
  link.textContent = "Download the output";
  ui.result.hidden = false;
  for (const id of ["view2d", "view3d"]) $(id).hidden = true;
  $("slide").hidden = false;
  $("canvas-box").classList.remove("volume", "image");
  $("canvas-box").classList.add("slide");
  view = slides;
  const facts = await slides.show(job.id, info);
  ui.location.textContent = `A slide of ${facts.width} x ${facts.height} pixels: drag to move, wheel to zoom.`;
  showSlideLegend($("legend"), facts, info);
  setChannels(kind === "labels" ? 1 : model.out_channels || 1, model.labels || {}, channel);
}

async function showResult(model, file, job) {
  const head = sniff(await file.slice(0, 1024).arrayBuffer());
  $("slide").hidden = true;
  $("canvas-box").classList.remove("slide");
  slides.close();
  if (await isSlide(job, head)) return showSlide(model, job);
  const result = await api.result(job.id);
  const kind = result.headers.get("x-tilewise-output") || (model.defaults || {}).output || "probabilities";
  const channel = firstChannel(kind, model);
  const info = { kind, labels: model.labels || {}, opacity: ui.opacity.value / 100, channel };
  const input = await file.arrayBuffer();
  const type = sniff(input);
  showFacts($("facts"), result.headers, job);
  showDownload($("download"), result);
  ui.result.hidden = false;
  $("view2d").hidden = true;
  $("view3d").hidden = true;
  $("canvas-box").classList.toggle("volume", type === "nifti");
  $("canvas-box").classList.toggle("image", type !== "nifti");
  let facts = null;
  if (type === "nifti") {
    const problem = viewerProblem();
    if (problem) {
      fail(new Error(`${problem} The output can still be downloaded.`));
      view = null;
    } else {
      $("view3d").hidden = false;
      view = volumes;
      facts = await volumes.show(input, result, info);
      ui.location.textContent = "Click a view, or focus it and use the arrow keys, to move the crosshair.";
    }
  } else {
    $("view2d").hidden = false;
    view = images;
    const picture = await pictureOfFile(input, type, pictureOf);
    facts = images.show(picture, await valuesOfFile(result.bytes), info);
    ui.location.textContent = "Click the image to read the output under a pixel.";
  }
  if (facts) {
    showLegend($("legend"), facts, info);
    setChannels(kind === "labels" ? 1 : facts.channels, model.labels || {}, channel);
    if (view && channel) view.setChannel(channel);
  }
}

/** The channel probabilities open on: the first that is not the background (channel 0 of a
 * softmax is "background" and would cover the whole box), when there are several. */
function firstChannel(kind, model) {
  if (kind === "labels" || (model.out_channels || 1) <= 1) return 0;
  const name = String((model.labels || {})[0] ?? "background").toLowerCase();
  return /background|^bg$|none|other/.test(name) ? 1 : 0;
}

function setChannels(count, labels, selected) {
  const name = (k) => (labels[k] !== undefined ? `${labels[k]} (channel ${k})` : `channel ${k}`);
  ui.channel.replaceChildren(...Array.from({ length: count }, (_, k) => new Option(name(k), String(k))));
  ui.channel.value = String(Math.min(selected, Math.max(0, count - 1)));
  ui.channelBox.hidden = count <= 1;
}

function boot() {
  ui.opacity.addEventListener("input", () => {
    ui.opacityValue.textContent = `${ui.opacity.value} %`;
    if (view) view.setOpacity(ui.opacity.value / 100);
  });
  ui.channel.addEventListener("change", () => view && view.setChannel(Number(ui.channel.value)));
  $("run-form").addEventListener("submit", (event) => {
    event.preventDefault();
    if (!ui.run.disabled) run();
  });
  ui.cancel.addEventListener("click", cancel);
  if (meta("tilewise-viewer") !== "niivue") {
    $("viewer-note").textContent = "The volume viewer is not installed here: run `tilewise setup-web`.";
  }
  if (meta("tilewise-api-key") === "required") {
    const keyForm = $("key-form");
    keyForm.hidden = false;
    say("Enter the API key.");
    keyForm.addEventListener("submit", async (event) => {
      event.preventDefault();
      api.key = $("api-key").value.trim() || null;
      if (await loadModels()) $("model").focus();
    });
    $("api-key").focus();
  } else {
    loadModels();
  }
}

boot();
