// Train LoRA node: a live loss curve from the `segckpt.loss` websocket events the node sends once
// per optimizer step ({node, step, total, loss}), the validation previews from `segckpt.preview`
// events ({node, step, images: [{filename, subfolder, type}]}) under it, and the guardrails' lines
// (the pre-flight verdict, schedule switches, watchdog reports) from `segckpt.notes` ({node, lines}).
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { addBottomPanel, fillText, fitHeight, textWidth } from "./segckpt_canvas.js";
import { frameAt, lossPoints, previewUrl, recordLoss, textLines, wrapLines } from "./segckpt_common.js";

const HEIGHT = 96;
const PREVIEW = 112;
const NOTE = 14;

const NOTE_FONT = "11px sans-serif";

/** The notes as drawn: wrapped to the node's width (none cut), cached per width. */
function notes(node) {
  const width = node.size[0] - 16;
  if (node.segckptNotesWrapped?.width !== width || node.segckptNotesWrapped.of !== node.segckptNotes) {
    const lines = wrapLines(node.segckptNotes ?? [], width, (text) => textWidth(text, NOTE_FONT));
    node.segckptNotesWrapped = { width, of: node.segckptNotes, lines };
  }
  return node.segckptNotesWrapped.lines;
}

function panelHeight(node) {
  return HEIGHT + (node.segckptPreviews?.images.length ? PREVIEW : 0) + notes(node).length * NOTE;
}

function draw(node, ctx, area) {
  const state = node.segckptLoss;
  ctx.save();
  ctx.font = "11px sans-serif";
  ctx.textBaseline = "middle";
  ctx.strokeStyle = "#3f3f46";
  ctx.strokeRect(area.x, area.y + 14, area.w, HEIGHT - 20);
  ctx.fillStyle = "#a1a1aa";
  if (!state?.history.length) {
    fillText(ctx, "loss: waiting for the first step", area.x, area.y + 6, area.w);
  } else {
    const last = state.history[state.history.length - 1];
    fillText(ctx, `step ${last.step}/${state.total}  loss ${last.loss.toFixed(4)}`, area.x, area.y + 6, area.w);
    const box = { x: area.x + 4, y: area.y + 18, w: area.w - 8, h: HEIGHT - 28 };
    const { points } = lossPoints(state.history, box, state.total);
    ctx.strokeStyle = "#60a5fa";
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    points.forEach(([x, y], i) => (i ? ctx.lineTo(x, y) : ctx.moveTo(x, y)));
    ctx.stroke();
  }
  const lines = notes(node);
  ctx.fillStyle = "#fbbf24";
  ctx.font = NOTE_FONT;
  lines.forEach((line, i) => ctx.fillText(line, area.x, area.y + HEIGHT + 4 + i * NOTE));
  node.segckptNotesDrawn = { lines, x: area.x, y: area.y + HEIGHT + 4, line: NOTE, font: NOTE_FONT, middle: true };
  const previews = node.segckptPreviews;
  if (previews?.images.length) {
    const y = area.y + HEIGHT + lines.length * NOTE;
    ctx.fillStyle = "#a1a1aa";
    fillText(ctx, `previews after step ${previews.step}`, area.x, y + 6, area.w);
    const side = PREVIEW - 20;
    previews.images.forEach((image, i) => {
      const clip = previews.clips?.[i];
      const shown = clip ? clip.bitmaps[frameAt(clip.durations, performance.now() - clip.start)] : image;
      if (clip || (image.complete && image.naturalWidth)) ctx.drawImage(shown, area.x + i * (side + 4), y + 14, side, side);
    });
    if (previews.clips?.some(Boolean)) setTimeout(() => redraw(node), 60);  // the clip moves
  }
  ctx.restore();
}

// The frames of an animated WebP (WebCodecs ImageDecoder; null where the browser has none: the
// first frame is shown, as an <img> drawn on a canvas shows it).
async function decodeClip(url) {
  if (typeof ImageDecoder === "undefined") return null;
  try {
    const response = await fetch(url);
    const decoder = new ImageDecoder({ data: response.body, type: "image/webp" });
    await decoder.tracks.ready;
    const count = decoder.tracks.selectedTrack.frameCount;
    const bitmaps = [], durations = [];
    for (let i = 0; i < count; i++) {
      const { image } = await decoder.decode({ frameIndex: i });
      bitmaps.push(await createImageBitmap(image));
      durations.push((image.duration ?? 62500) / 1000);  // microseconds -> ms
      image.close();
    }
    decoder.close();
    return count > 1 ? { bitmaps, durations, start: performance.now() } : null;
  } catch {
    return null;
  }
}

function nodeById(id) {
  return app.graph?.getNodeById(Number(id)) ?? app.graph?.getNodeById(id) ?? null;
}

function redraw(node) {
  node.setDirtyCanvas?.(true, false);
  app.graph.setDirtyCanvas?.(true, false);
}

app.registerExtension({
  name: "segckpt.TrainLossCurve",
  async setup() {
    api.addEventListener("segckpt.loss", ({ detail }) => {
      const node = nodeById(detail.node);
      if (!node) return;
      const state = (node.segckptLoss ??= { history: [], total: detail.total });
      state.history = recordLoss(state.history, detail);
      state.total = detail.total;
      redraw(node);
    });
    api.addEventListener("segckpt.preview", ({ detail }) => {
      const node = nodeById(detail.node);
      if (!node) return;
      const images = detail.images.map((file) => {
        const image = new Image();
        image.onload = () => redraw(node);
        image.src = api.apiURL(previewUrl(file));
        return image;
      });
      const previews = (node.segckptPreviews = { step: detail.step, images, clips: [] });
      detail.images.forEach((file, i) => {
        if (!file.filename.endsWith(".webp")) return;  // a video family's animated preview
        decodeClip(api.apiURL(previewUrl(file))).then((clip) => {
          if (clip && node.segckptPreviews === previews) previews.clips[i] = clip;
          redraw(node);
        });
      });
      fitHeight(node);
      redraw(node);
    });
    api.addEventListener("segckpt.notes", ({ detail }) => {
      const node = nodeById(detail.node);
      if (!node) return;
      node.segckptNotes = textLines(detail.lines);
      fitHeight(node);
      redraw(node);
    });
  },
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData.name !== "SegCkptTrainLoRA") return;
    addBottomPanel(nodeType, panelHeight, draw);
    const onNodeCreated = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function () {
      const result = onNodeCreated?.apply(this, arguments);
      fitHeight(this);
      return result;
    };
  },
});
