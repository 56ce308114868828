// The HTTP API of this server: models, jobs, the job's event stream and its result.
// Every request goes to the page's own origin; the API key, when the server needs one, is sent
// as "Authorization: Bearer <key>" (EventSource cannot send headers, so events are read from a
// fetch() body).

/** An error answer of the server: its JSON {error, detail} (or the status text). */
export class ApiError extends Error {
  constructor(status, code, detail) {
    super(detail ? `${code}: ${detail}` : code);
    this.status = status;
    this.code = code;
    this.detail = detail;
  }
}

async function failure(response) {
  let code = `HTTP ${response.status}`;
  let detail = response.statusText;
  try {
    const body = await response.json();
    code = body.error || code;
    detail = body.detail || detail;
  } catch {
    // not JSON: keep the status line
  }
  return new ApiError(response.status, code, detail);
}

export class Api {
  constructor() {
    this.key = null;
  }

  headers(extra = {}) {
    return this.key ? { ...extra, Authorization: `Bearer ${this.key}` } : extra;
  }

  async request(method, path, { body, signal } = {}) {
    const response = await fetch(path, { method, body, signal, headers: this.headers(), cache: "no-store" });
    if (!response.ok) throw await failure(response);
    return response;
  }

  /** GET /v1/models: the list of model descriptions. */
  async models() {
    return (await this.request("GET", "/v1/models")).json();
  }

  /** POST /v1/jobs?model=NAME&params with the file as multipart "file"; the job's status. */
  async submit(model, params, file) {
    const query = new URLSearchParams({ model, ...params });
    const form = new FormData();
    form.append("file", file, file.name);
    return (await this.request("POST", `/v1/jobs?${query}`, { body: form })).json();
  }

  /** DELETE /v1/jobs/{id}: ask the server to stop the job. */
  async cancel(id) {
    return (await this.request("DELETE", `/v1/jobs/${encodeURIComponent(id)}`)).json();
  }

  /** GET /v1/jobs/{id}: the job's status. */
  async job(id) {
    return (await this.request("GET", `/v1/jobs/${encodeURIComponent(id)}`)).json();
  }

  /**
   * Follow GET /v1/jobs/{id}/events until its final event; calls onEvent(name, status) for each.
   * Resolves with the final event's name (done, failed, cancelled).
   */
  async follow(id, onEvent, signal) {
    const response = await this.request("GET", `/v1/jobs/${encodeURIComponent(id)}/events`, { signal });
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    let last = null;
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value.replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const event = parseEvent(block);
        if (event === null) continue;
        if (event.name === "error") throw new ApiError(404, event.data.error || "unknown_job", "the job is gone");
        last = event.name;
        onEvent(event.name, event.data);
      }
    }
    if (!["done", "failed", "cancelled"].includes(last)) {
      throw new ApiError(0, "stream_ended", "the event stream ended before the job did");
    }
    return last;
  }

  /** GET /v1/jobs/{id}/result: {bytes, headers, filename, type}. */
  async result(id) {
    const response = await this.request("GET", `/v1/jobs/${encodeURIComponent(id)}/result`);
    const bytes = await response.arrayBuffer();
    const disposition = response.headers.get("content-disposition") || "";
    const match = /filename\*?=(?:UTF-8'')?"?([^";]+)"?/i.exec(disposition);
    return {
      bytes,
      headers: response.headers,
      filename: match ? decodeURIComponent(match[1]) : `result-${id}`,
      type: response.headers.get("content-type") || "application/octet-stream",
    };
  }
}

/** One server-sent event block as {name, data}; null for a comment-only block. */
export function parseEvent(block) {
  let name = "message";
  const data = [];
  for (const line of block.split("\n")) {
    if (line === "" || line.startsWith(":")) continue;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
    if (field === "event") name = value;
    else if (field === "data") data.push(value);
  }
  if (data.length === 0) return null;
  return { name, data: JSON.parse(data.join("\n")) };
}
