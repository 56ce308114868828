// Run the chosen model on a series of the server's PACS (TILEWISE_DICOMWEB_URL), named by its UIDs:
// POST /v1/jobs?model&study&series[&store=true] with no body, then the job's status until it ends.
import { Api, ApiError } from "./api.js";

const $ = (id) => document.getElementById(id);
const api = new Api();

function say(text, failed = false) {
  const line = $("pacs-status");
  line.textContent = text;
  line.classList.toggle("error", failed);
}

async function follow(id) {
  for (;;) {
    const status = await api.request("GET", `/v1/jobs/${encodeURIComponent(id)}`).then((r) => r.json());
    if (status.state === "done") return status;
    if (status.state === "failed" || status.state === "cancelled") {
      const error = status.error || {};
      throw new ApiError(0, error.error || status.state, error.detail || "");
    }
    say(`job ${id}: ${status.state} ${Math.round((status.progress || 0) * 100)} %`);
    await new Promise((resolve) => setTimeout(resolve, 1000));
  }
}

async function run(event) {
  event.preventDefault();
  api.key = ($("api-key") && $("api-key").value.trim()) || null;
  const model = $("model").value;
  const study = $("pacs-study").value.trim();
  const series = $("pacs-series").value.trim();
  if (!model || !study || !series) {
    say("Choose a model and give the study and series UIDs.", true);
    return;
  }
  const query = new URLSearchParams({ model, study, series });
  if ($("pacs-store").checked) query.set("store", "true");
  $("pacs-run").disabled = true;
  try {
    const job = await api.request("POST", `/v1/jobs?${query}`).then((r) => r.json());
    say(`job ${job.id}: queued`);
    const done = await follow(job.id);
    say(done.stored
      ? `Done: the SEG is stored in the PACS as series ${done.stored.series} (instance ${done.stored.sop_instance}).`
      : `Done: download the result from /v1/jobs/${done.id}/result.`);
  } catch (error) {
    say(`${error.code || "error"}: ${error.detail || error.message}`, true);
  } finally {
    $("pacs-run").disabled = false;
  }
}

$("pacs-form").addEventListener("submit", run);
