// What a file is (by its first bytes, as the server decides too), and its picture or values.

import { decodePng } from "./png.js";
import { decodeTiff } from "./tiff.js";

/** "nifti", "png", "jpeg", "tiff", "npy" or null, from the first bytes of an ArrayBuffer. */
export function sniff(buffer) {
  const b = new Uint8Array(buffer, 0, Math.min(buffer.byteLength, 352));
  if (b.length >= 2 && b[0] === 0x1f && b[1] === 0x8b) return "nifti"; // the only gzip format read
  if (b.length >= 8 && b[0] === 0x89 && b[1] === 0x50 && b[2] === 0x4e && b[3] === 0x47) return "png";
  if (b.length >= 3 && b[0] === 0xff && b[1] === 0xd8 && b[2] === 0xff) return "jpeg";
  if (b.length >= 4 && ((b[0] === 0x49 && b[1] === 0x49 && b[2] === 42) || (b[0] === 0x4d && b[1] === 0x4d && b[3] === 42))) {
    return "tiff";
  }
  if (b.length >= 6 && b[0] === 0x93 && String.fromCharCode(...b.subarray(1, 6)) === "NUMPY") return "npy";
  if (b.length >= 348) {
    const view = new DataView(buffer);
    const size = view.getInt32(0, true);
    const sizeBig = view.getInt32(0, false);
    if ([348, 540].includes(size) || [348, 540].includes(sizeBig)) return "nifti";
  }
  return null;
}

/** The picture of an input image file for the 2D view: {width, height, rgba}. */
export async function pictureOfFile(buffer, kind, pictureOf) {
  if (kind === "tiff") return pictureOf(await decodeTiff(buffer));
  const bitmap = await createImageBitmap(new Blob([buffer]));
  const canvas = new OffscreenCanvas(bitmap.width, bitmap.height);
  const context = canvas.getContext("2d");
  context.drawImage(bitmap, 0, 0);
  bitmap.close();
  const { data } = context.getImageData(0, 0, canvas.width, canvas.height);
  return { width: canvas.width, height: canvas.height, rgba: data };
}

function decodeNpy(buffer) {
  const view = new DataView(buffer);
  const major = view.getUint8(6);
  const headerLength = major === 1 ? view.getUint16(8, true) : view.getUint32(8, true);
  const start = major === 1 ? 10 : 12;
  const header = new TextDecoder().decode(new Uint8Array(buffer, start, headerLength));
  const descr = /'descr':\s*'([^']+)'/.exec(header)[1];
  if (/'fortran_order':\s*True/.test(header)) throw new Error("Fortran-ordered .npy is not supported");
  const shape = /'shape':\s*\(([^)]*)\)/.exec(header)[1].split(",").filter((s) => s.trim()).map(Number);
  const kinds = { "|u1": Uint8Array, "<u2": Uint16Array, "<i2": Int16Array, "<i4": Int32Array, "<f4": Float32Array, "<f8": Float64Array };
  const Kind = kinds[descr];
  if (!Kind) throw new Error(`.npy of type ${descr} is not supported`);
  const offset = start + headerLength;
  const data = new Kind(buffer.slice(offset));
  const [height, width] = shape.slice(-2);
  const channels = shape.length === 3 ? shape[0] : 1;
  const planes = Array.from({ length: channels }, (_, c) => data.subarray(c * width * height, (c + 1) * width * height));
  return { width, height, channels, planes, palette: null };
}

/** The values of a 2D output file: {width, height, channels, planes}. */
export async function valuesOfFile(buffer) {
  const kind = sniff(buffer);
  if (kind === "png") return decodePng(buffer);
  if (kind === "tiff") return decodeTiff(buffer);
  if (kind === "npy") return decodeNpy(buffer);
  throw new Error(`a 2D output in this format (${kind || "unknown"}) cannot be shown; download it`);
}
