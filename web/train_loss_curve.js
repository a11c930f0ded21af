// Train LoRA node: a live loss curve from the `segckpt.loss` websocket events the node sends once
// per optimizer step ({node, step, total, loss}), the validation previews from `segckpt.preview`
// events ({node, step, images: [{filename, subfolder, type}]}) under it, and the guardrails' lines
// (the pre-flight verdict, schedule switches, watchdog reports) from `segckpt.notes` ({node, lines}).
// All of it in a results widget below the node's last widget (segckpt_canvas.js), laid out by
// trainPanelLayout (segckpt_common.js): the node grows to fit, never draws on a widget's row.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { addResultsWidget, fillText, fitHeight, PAD, textWidth } from "./segckpt_canvas.js";
import { frameAt, lossPoints, previewUrl, recordLoss, textLines, trainPanelLayout, wrapLines } from "./segckpt_common.js";

const RESULTS = "segckpt_train_results";
const FONT = "11px sans-serif";

/** The notes as drawn: wrapped to the node's width (none cut), cached per width. */
function notes(node) {
  const width = node.size[0] - 2 * PAD;
  if (node.segckptNotesWrapped?.width !== width || node.segckptNotesWrapped.of !== node.segckptNotes) {
    const lines = wrapLines(node.segckptNotes ?? [], width, (text) => textWidth(text, FONT));
    node.segckptNotesWrapped = { width, of: node.segckptNotes, lines };
  }
  return node.segckptNotesWrapped.lines;
}

function layout(node, width = node.size[0] - 2 * PAD) {
  return trainPanelLayout(width, notes(node).length, node.segckptPreviews?.images.length ?? 0);
}

function draw(node, ctx, area) {
  const state = node.segckptLoss;
  const parts = layout(node, area.w);
  const at = (box) => ({ x: area.x + box.x, y: area.y + box.y, w: box.w, h: box.h });
  const label = at(parts.label), curve = at(parts.curve);
  ctx.save();
  ctx.font = FONT;
  ctx.textBaseline = "middle";
  ctx.strokeStyle = "#3f3f46";
  ctx.strokeRect(curve.x, curve.y, curve.w, curve.h);
  ctx.fillStyle = "#a1a1aa";
  if (!state?.history.length) {
    fillText(ctx, "loss: waiting for the first step", label.x, label.y + label.h / 2, label.w);
  } else {
    const last = state.history[state.history.length - 1];
    fillText(ctx, `step ${last.step}/${state.total}  loss ${last.loss.toFixed(4)}`, label.x, label.y + label.h / 2, label.w);
    const box = { x: curve.x + 4, y: curve.y + 4, w: curve.w - 8, h: curve.h - 8 };
    const { points } = lossPoints(state.history, box, state.total);
    ctx.strokeStyle = "#60a5fa";
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    points.forEach(([x, y], i) => (i ? ctx.lineTo(x, y) : ctx.moveTo(x, y)));
    ctx.stroke();
  }
  const lines = notes(node);
  ctx.fillStyle = "#fbbf24";
  parts.notes.map(at).forEach((row, i) => ctx.fillText(lines[i], row.x, row.y + row.h / 2));
  if (parts.notes.length) {
    const first = at(parts.notes[0]);
    node.segckptNotesDrawn = { lines, x: first.x, y: first.y + first.h / 2, line: parts.notes[0].h, font: FONT, middle: true };
  }
  const previews = node.segckptPreviews;
  if (parts.previewLabel) {
    const top = at(parts.previewLabel);
    ctx.fillStyle = "#a1a1aa";
    fillText(ctx, `previews after step ${previews.step}`, top.x, top.y + top.h / 2, top.w);
    parts.images.map(at).forEach((box, i) => {
      const image = previews.images[i], clip = previews.clips?.[i];
      const shown = clip ? clip.bitmaps[frameAt(clip.durations, performance.now() - clip.start)] : image;
      if (clip || (image.complete && image.naturalWidth)) ctx.drawImage(shown, box.x, box.y, box.w, box.h);
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
    addResultsWidget(nodeType, RESULTS, (node) => layout(node).height, draw);
  },
});
