// A baseline TIFF decoder for the first image of a file: strips or tiles; uncompressed, deflate,
// LZW or PackBits; horizontal predictor; 8/16/32-bit integers and 32/64-bit floats; chunky or
// planar samples. tilewise writes its 2D outputs as uncompressed TIFF (float32 probabilities,
// uint8 labels), which this reads exactly; browsers cannot show TIFF at all.

import { concat, inflate } from "./inflate.js";

const TYPE_SIZE = { 1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 1, 7: 1, 8: 2, 9: 4, 10: 8, 11: 4, 12: 8, 16: 8 };

function readTags(view, offset, little) {
  const count = view.getUint16(offset, little);
  const tags = {};
  for (let k = 0; k < count; k++) {
    const at = offset + 2 + 12 * k;
    const tag = view.getUint16(at, little);
    const type = view.getUint16(at + 2, little);
    const n = view.getUint32(at + 4, little);
    const size = (TYPE_SIZE[type] || 1) * n;
    const where = size <= 4 ? at + 8 : view.getUint32(at + 8, little);
    const values = [];
    for (let i = 0; i < n; i++) {
      if (type === 3) values.push(view.getUint16(where + 2 * i, little));
      else if (type === 4) values.push(view.getUint32(where + 4 * i, little));
      else if (type === 1 || type === 7 || type === 2) values.push(view.getUint8(where + i));
      else if (type === 16) values.push(Number(view.getBigUint64(where + 8 * i, little)));
      else values.push(view.getUint32(where + 4 * i, little)); // rationals etc.: not used here
    }
    tags[tag] = values;
  }
  return tags;
}

function unpackBits(bytes, expected) {
  const out = new Uint8Array(expected);
  let i = 0;
  let o = 0;
  while (i < bytes.length && o < expected) {
    const n = (bytes[i] << 24) >> 24;
    i++;
    if (n >= 0) {
      out.set(bytes.subarray(i, i + n + 1), o);
      i += n + 1;
      o += n + 1;
    } else if (n !== -128) {
      out.fill(bytes[i], o, o - n + 1);
      o += -n + 1;
      i++;
    }
  }
  return out;
}

function lzw(bytes, expected) {
  const out = new Uint8Array(expected);
  let o = 0;
  let table = [];
  let width = 9;
  let bit = 0;
  let previous = null;
  const reset = () => {
    table = [];
    for (let k = 0; k < 256; k++) table.push(Uint8Array.of(k));
    table.push(null, null);
    width = 9;
  };
  const code = () => {
    let value = 0;
    for (let k = 0; k < width; k++) {
      const b = bit + k;
      if (b >> 3 >= bytes.length) return 257;
      value = (value << 1) | ((bytes[b >> 3] >> (7 - (b & 7))) & 1);
    }
    bit += width;
    return value;
  };
  reset();
  for (;;) {
    const c = code();
    if (c === 257) break;
    if (c === 256) {
      reset();
      previous = null;
      continue;
    }
    let entry;
    if (c < table.length && table[c] !== null) {
      entry = table[c];
      if (previous !== null) table.push(concat([previous, entry.subarray(0, 1)]));
    } else if (previous !== null) {
      entry = concat([previous, previous.subarray(0, 1)]);
      table.push(entry);
    } else {
      throw new Error("TIFF LZW: corrupt data");
    }
    out.set(entry.subarray(0, Math.max(0, expected - o)), o);
    o += entry.length;
    previous = entry;
    if (table.length + 1 >= 1 << width && width < 12) width++;
  }
  return out;
}

async function decompress(bytes, compression, expected) {
  if (compression === 1) return bytes;
  if (compression === 8 || compression === 32946) return inflate(bytes);
  if (compression === 5) return lzw(bytes, expected);
  if (compression === 32773) return unpackBits(bytes, expected);
  throw new Error(`TIFF compression ${compression} is not supported`);
}

function arrayKind(format, bits) {
  if (format === 3 && bits === 32) return Float32Array;
  if (format === 3 && bits === 64) return Float64Array;
  const signed = format === 2;
  if (bits === 8) return signed ? Int8Array : Uint8Array;
  if (bits === 16) return signed ? Int16Array : Uint16Array;
  if (bits === 32) return signed ? Int32Array : Uint32Array;
  throw new Error(`TIFF samples of ${bits} bits (format ${format}) are not supported`);
}

function readSample(view, at, Kind, little) {
  switch (Kind) {
    case Uint8Array: return view.getUint8(at);
    case Int8Array: return view.getInt8(at);
    case Uint16Array: return view.getUint16(at, little);
    case Int16Array: return view.getInt16(at, little);
    case Uint32Array: return view.getUint32(at, little);
    case Int32Array: return view.getInt32(at, little);
    case Float32Array: return view.getFloat32(at, little);
    default: return view.getFloat64(at, little);
  }
}

/**
 * Decode the first image of a TIFF file.
 * @returns {{width, height, channels, planes: TypedArray[], palette: null}}
 */
export async function decodeTiff(buffer) {
  const view = new DataView(buffer);
  const order = view.getUint16(0);
  if (order !== 0x4949 && order !== 0x4d4d) throw new Error("not a TIFF file");
  const little = order === 0x4949;
  if (view.getUint16(2, little) !== 42) throw new Error("BigTIFF is not supported");
  const tags = readTags(view, view.getUint32(4, little), little);
  const get = (tag, fallback) => (tags[tag] ? tags[tag][0] : fallback);
  const width = get(256);
  const height = get(257);
  const channels = get(277, 1);
  const bits = get(258, 1);
  const format = get(339, 1);
  const compression = get(259, 1);
  const predictor = get(317, 1);
  const planar = get(284, 1) === 2;
  const Kind = arrayKind(format, bits);
  const bytesPer = bits / 8;
  const tiled = tags[322] !== undefined;
  const blockW = tiled ? get(322) : width;
  const blockH = tiled ? get(323) : get(278, height);
  const offsets = tiled ? tags[324] : tags[273];
  const counts = tiled ? tags[325] : tags[279];
  if (predictor === 3) throw new Error("TIFF floating-point predictor is not supported");
  const across = Math.ceil(width / blockW);
  const down = Math.ceil(height / blockH);
  const perPlane = across * down;
  const planes = Array.from({ length: channels }, () => new Kind(width * height));
  const spp = planar ? 1 : channels;
  for (let b = 0; b < offsets.length; b++) {
    const plane = planar ? Math.floor(b / perPlane) : 0;
    const index = b % perPlane;
    const x0 = (index % across) * blockW;
    const y0 = Math.floor(index / across) * blockH;
    const rows = tiled ? blockH : Math.min(blockH, height - y0);
    const expected = blockW * rows * spp * bytesPer;
    const raw = new Uint8Array(buffer, offsets[b], counts[b]);
    const bytes = await decompress(raw.slice(), compression, expected);
    const block = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
    const values = new Kind(blockW * rows * spp);
    for (let k = 0; k < values.length; k++) values[k] = readSample(block, k * bytesPer, Kind, little);
    if (predictor === 2) {
      for (let y = 0; y < rows; y++) {
        for (let k = spp; k < blockW * spp; k++) values[y * blockW * spp + k] += values[y * blockW * spp + k - spp];
      }
    }
    for (let y = 0; y < rows && y0 + y < height; y++) {
      for (let x = 0; x < blockW && x0 + x < width; x++) {
        for (let s = 0; s < spp; s++) {
          planes[plane + s][(y0 + y) * width + x0 + x] = values[(y * blockW + x) * spp + s];
        }
      }
    }
  }
  return { width, height, channels, planes, palette: null };
}
