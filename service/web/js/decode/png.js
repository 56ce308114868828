// A PNG decoder that keeps the stored values: a palette PNG gives its indices (the label ids of a
// tilewise label image), a 16-bit PNG its 16-bit values. The browser's own decoder gives colours
// only, so it serves the input's picture but not the output's values. Non-interlaced PNGs only
// (tilewise writes those).

import { concat, inflate } from "./inflate.js";

const SIGNATURE = [137, 80, 78, 71, 13, 10, 26, 10];
const CHANNELS = { 0: 1, 2: 3, 3: 1, 4: 2, 6: 4 };

function paeth(a, b, c) {
  const p = a + b - c;
  const pa = Math.abs(p - a);
  const pb = Math.abs(p - b);
  const pc = Math.abs(p - c);
  if (pa <= pb && pa <= pc) return a;
  return pb <= pc ? b : c;
}

function unfilter(raw, height, stride, bpp) {
  const out = new Uint8Array(height * stride);
  for (let y = 0; y < height; y++) {
    const type = raw[y * (stride + 1)];
    const line = raw.subarray(y * (stride + 1) + 1, (y + 1) * (stride + 1));
    const row = y * stride;
    for (let x = 0; x < stride; x++) {
      const a = x >= bpp ? out[row + x - bpp] : 0;
      const b = y > 0 ? out[row - stride + x] : 0;
      const c = x >= bpp && y > 0 ? out[row - stride + x - bpp] : 0;
      let v = line[x];
      if (type === 1) v += a;
      else if (type === 2) v += b;
      else if (type === 3) v += (a + b) >> 1;
      else if (type === 4) v += paeth(a, b, c);
      else if (type !== 0) throw new Error(`PNG: unknown filter type ${type} in row ${y}`);
      out[row + x] = v & 255;
    }
  }
  return out;
}

/**
 * Decode a PNG.
 * @returns {{width, height, channels, bitDepth, planes: TypedArray[], palette: number[][] | null}}
 *   planes[c][y * width + x] is the stored value (a palette index for palette PNGs).
 */
export async function decodePng(buffer) {
  const bytes = new Uint8Array(buffer);
  if (!SIGNATURE.every((v, i) => bytes[i] === v)) throw new Error("not a PNG file");
  const view = new DataView(buffer);
  let at = 8;
  let header = null;
  let palette = null;
  const data = [];
  while (at + 8 <= bytes.length) {
    const length = view.getUint32(at);
    const type = String.fromCharCode(...bytes.subarray(at + 4, at + 8));
    const body = bytes.subarray(at + 8, at + 8 + length);
    if (type === "IHDR") {
      header = {
        width: view.getUint32(at + 8),
        height: view.getUint32(at + 12),
        bitDepth: body[8],
        colorType: body[9],
        interlace: body[12],
      };
    } else if (type === "PLTE") {
      palette = [];
      for (let k = 0; k + 2 < body.length; k += 3) palette.push([body[k], body[k + 1], body[k + 2]]);
    } else if (type === "IDAT") {
      data.push(body);
    } else if (type === "IEND") {
      break;
    }
    at += 12 + length;
  }
  if (header === null) throw new Error("PNG without IHDR");
  if (header.interlace !== 0) throw new Error("interlaced PNG is not supported");
  const channels = CHANNELS[header.colorType];
  if (channels === undefined) throw new Error(`PNG colour type ${header.colorType} is not supported`);
  const { width, height, bitDepth } = header;
  const bitsPerPixel = channels * bitDepth;
  const stride = Math.ceil((width * bitsPerPixel) / 8);
  const raw = await inflate(concat(data));
  if (raw.length < height * (stride + 1)) throw new Error("PNG data is truncated");
  const rows = unfilter(raw, height, stride, Math.max(1, bitsPerPixel >> 3));
  const Kind = bitDepth === 16 ? Uint16Array : Uint8Array;
  const planes = Array.from({ length: channels }, () => new Kind(width * height));
  for (let y = 0; y < height; y++) {
    const row = y * stride;
    for (let x = 0; x < width; x++) {
      for (let c = 0; c < channels; c++) {
        const sample = x * channels + c;
        let value;
        if (bitDepth === 16) value = (rows[row + 2 * sample] << 8) | rows[row + 2 * sample + 1];
        else if (bitDepth === 8) value = rows[row + sample];
        else {
          const bit = sample * bitDepth;
          value = (rows[row + (bit >> 3)] >> (8 - bitDepth - (bit & 7))) & ((1 << bitDepth) - 1);
        }
        planes[c][y * width + x] = value;
      }
    }
  }
  return { width, height, channels, bitDepth, planes, palette: header.colorType === 3 ? palette : null };
}
