// The run form: the model list (from /v1/models), the file (dropped or chosen), the tiling options.

const OPTIONS = ["tile", "halo", "overlap"];

function text(value) {
  if (value === null || value === undefined) return "";
  return Array.isArray(value) ? value.join(",") : String(value);
}

/** One line about a model: dimensions, channels, output, labels, spacing, defaults. */
export function describe(model) {
  const parts = [`${model.spatial_dims}D`, `${model.in_channels} → ${model.out_channels} channels`];
  const defaults = model.defaults || {};
  if (defaults.output) parts.push(`output ${defaults.output}`);
  if (model.labels) parts.push(`labels: ${Object.values(model.labels).join(", ")}`);
  if (model.spacing) parts.push(`spacing ${model.spacing.join(" × ")} mm`);
  if (model.tile_dependent) parts.push("tile-dependent (seams measured)");
  if (model.status === "unavailable") parts.push(`unavailable: ${model.reason || "no reason given"}`);
  const text = model.description ? `${model.description} ` : "";
  return `${text}(${parts.join("; ")})`;
}

export class RunForm {
  constructor(onChange) {
    this.onChange = onChange;
    this.models = [];
    this.file = null;
    this.select = document.getElementById("model");
    this.info = document.getElementById("model-info");
    this.input = document.getElementById("file");
    this.drop = document.getElementById("drop");
    this.fileName = document.getElementById("file-name");
    this.tta = document.getElementById("opt-tta");
    this.output = document.getElementById("opt-output");
    this.select.addEventListener("change", () => this.modelChanged());
    this.input.addEventListener("change", () => this.setFile(this.input.files[0] || null));
    this.drop.addEventListener("keydown", (event) => {
      if (event.key === "Enter" || event.key === " ") {
        event.preventDefault();
        this.input.click();
      }
    });
    for (const name of ["dragenter", "dragover"]) {
      this.drop.addEventListener(name, (event) => {
        event.preventDefault();
        this.drop.classList.add("over");
      });
    }
    for (const name of ["dragleave", "drop"]) {
      this.drop.addEventListener(name, () => this.drop.classList.remove("over"));
    }
    this.drop.addEventListener("drop", (event) => {
      event.preventDefault();
      const file = event.dataTransfer.files[0];
      if (file) this.setFile(file);
    });
  }

  setModels(models) {
    const previous = this.select.value;
    this.models = models;
    this.select.replaceChildren();
    for (const model of models) {
      const option = new Option(`${model.name} (${model.spatial_dims}D)`, model.name);
      option.disabled = model.status === "unavailable";
      this.select.append(option);
    }
    const keep = models.find((m) => m.name === previous && m.status !== "unavailable");
    const first = keep || models.find((m) => m.status !== "unavailable");
    this.select.value = first ? first.name : "";
    this.select.disabled = models.length === 0;
    this.modelChanged();
  }

  model() {
    return this.models.find((m) => m.name === this.select.value) || null;
  }

  modelChanged() {
    const model = this.model();
    this.info.textContent = model ? describe(model) : "No model available.";
    const defaults = (model && model.defaults) || {};
    for (const name of OPTIONS) {
      document.getElementById(`opt-${name}`).placeholder = text(defaults[name]);
    }
    this.output.options[0].textContent = `model default${defaults.output ? ` (${defaults.output})` : ""}`;
    this.onChange();
  }

  setFile(file) {
    this.file = file;
    this.fileName.textContent = file ? `${file.name} (${(file.size / 1e6).toFixed(2)} MB)` : "no file chosen";
    this.onChange();
  }

  /** The query parameters given (empty fields mean the model's defaults). */
  params() {
    const out = {};
    for (const name of OPTIONS) {
      const value = document.getElementById(`opt-${name}`).value.replace(/\s+/g, "");
      if (value) out[name] = value;
    }
    if (this.output.value) out.output = this.output.value;
    if (this.tta.value !== "none") out.tta = this.tta.value;
    return out;
  }

  ready() {
    return this.model() !== null && this.file !== null;
  }
}
