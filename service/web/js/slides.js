// Slides and large 2D results: OpenSeadragon (served by this server, see service/webassets.py)
// draws the job's input and, over it, its result, both from the job's deep-zoom tiles
// (GET /v1/jobs/{id}/dzi/{input|result}.dzi and their tiles). The descriptors are read here with
// the API key, and tiles are fetched by OpenSeadragon with the same Authorization header.

import { ApiError } from "./api.js";

/** Whether OpenSeadragon is installed on this server (tilewise setup-web). */
export function slidesAvailable() {
  const tag = document.querySelector('meta[name="tilewise-slides"]');
  return Boolean(tag && tag.content === "openseadragon" && window.OpenSeadragon);
}

/** Largest side (pixels) drawn on the page's own canvas; past it, deep-zoom tiles. */
export const SLIDE_EDGE = 2048;

export class SlideView {
  constructor(element, api) {
    this.element = element;
    this.api = api;
    this.viewer = null;
    this.overlay = null;
    this.opacity = 0.6;
    this.channel = 0;
    this.job = null;
  }

  /** GET the .dzi of the job's input or result: {source, width, height, headers}. */
  async descriptor(jobId, role, channel = 0) {
    const base = `/v1/jobs/${encodeURIComponent(jobId)}/dzi/${role}`;
    const response = await this.api.request("GET", `${base}.dzi`);
    const xml = new DOMParser().parseFromString(await response.text(), "application/xml");
    const image = xml.getElementsByTagName("Image")[0];
    const size = xml.getElementsByTagName("Size")[0];
    if (!image || !size) throw new ApiError(response.status, "bad_descriptor", `${role}.dzi is no Deep Zoom image`);
    const width = Number(size.getAttribute("Width"));
    const height = Number(size.getAttribute("Height"));
    const source = new window.OpenSeadragon.DziTileSource({
      width,
      height,
      tileSize: Number(image.getAttribute("TileSize")),
      tileOverlap: Number(image.getAttribute("Overlap")),
      tilesUrl: `${base}_files/`,
      fileFormat: image.getAttribute("Format"),
      queryParams: role === "result" ? `?channel=${channel}` : "",
    });
    return { source, width, height, headers: response.headers };
  }

  /** The job's input with its result over it. @returns facts for the legend ({range}). */
  async show(jobId, meta) {
    this.job = jobId;
    this.opacity = meta.opacity;
    this.channel = meta.channel || 0;
    const input = await this.descriptor(jobId, "input");
    const result = await this.descriptor(jobId, "result", this.channel);
    this.close();
    const headers = this.api.key ? { Authorization: `Bearer ${this.api.key}` } : {};
    this.viewer = window.OpenSeadragon({
      element: this.element,
      tileSources: input.source,
      showNavigationControl: false,
      drawer: "canvas",
      loadTilesWithAjax: true,
      ajaxHeaders: headers,
      gestureSettingsMouse: { clickToZoom: false },
      visibilityRatio: 0.5,
      minPixelRatio: 0.9, // sharp: a level is drawn at no less than 0.9 of its pixels per screen pixel
    });
    await new Promise((resolve, reject) => {
      this.viewer.addOnceHandler("open", resolve);
      this.viewer.addOnceHandler("open-failed", (event) => reject(new Error(`the slide cannot be opened: ${event.message}`)));
    });
    await this.addOverlay(result.source);
    const range = (result.headers.get("x-tilewise-range") || "0,1").split(",").map(Number);
    return { width: input.width, height: input.height, range, kind: result.headers.get("x-tilewise-output") || meta.kind };
  }

  addOverlay(source) {
    return new Promise((resolve, reject) => {
      this.viewer.addTiledImage({
        tileSource: source,
        opacity: this.opacity,
        success: (event) => {
          if (this.overlay) this.viewer.world.removeItem(this.overlay);
          this.overlay = event.item;
          resolve();
        },
        error: (event) => reject(new Error(`the overlay cannot be opened: ${event.message}`)),
      });
    });
  }

  /** Whether every tile in view has been drawn (for tests and screenshots). */
  settled() {
    if (!this.viewer) return false;
    const world = this.viewer.world;
    if (world.getItemCount() < 2) return false;
    for (let k = 0; k < world.getItemCount(); k++) if (!world.getItemAt(k).getFullyLoaded()) return false;
    return true;
  }

  setOpacity(value) {
    this.opacity = value;
    if (this.overlay) this.overlay.setOpacity(value);
  }

  async setChannel(index) {
    this.channel = index;
    if (!this.viewer || !this.job) return;
    const result = await this.descriptor(this.job, "result", index);
    await this.addOverlay(result.source);
  }

  close() {
    if (this.viewer) this.viewer.destroy();
    this.viewer = null;
    this.overlay = null;
  }
}
