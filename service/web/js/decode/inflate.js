// zlib (RFC 1950) decompression with the browser's own DecompressionStream.

/** Inflate zlib-wrapped bytes (PNG IDAT, TIFF deflate) into a Uint8Array. */
export async function inflate(bytes) {
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("deflate"));
  return new Uint8Array(await new Response(stream).arrayBuffer());
}

/** Concatenate Uint8Arrays. */
export function concat(parts) {
  const total = parts.reduce((n, p) => n + p.length, 0);
  const out = new Uint8Array(total);
  let at = 0;
  for (const part of parts) {
    out.set(part, at);
    at += part.length;
  }
  return out;
}
