// Train LoRA node: a live loss curve from the `segckpt.loss` websocket events the node sends once
// per optimizer step ({node, step, total, loss}).
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { addBottomPanel, fillText, fitHeight } from "./segckpt_canvas.js";
import { lossPoints, recordLoss } from "./segckpt_common.js";

const HEIGHT = 96;

function draw(node, ctx, area) {
  const state = node.segckptLoss;
  ctx.save();
  ctx.font = "11px sans-serif";
  ctx.textBaseline = "middle";
  ctx.strokeStyle = "#3f3f46";
  ctx.strokeRect(area.x, area.y + 14, area.w, area.h - 14);
  ctx.fillStyle = "#a1a1aa";
  if (!state?.history.length) {
    fillText(ctx, "loss: waiting for the first step", area.x, area.y + 6, area.w);
    ctx.restore();
    return;
  }
  const last = state.history[state.history.length - 1];
  fillText(ctx, `step ${last.step}/${state.total}  loss ${last.loss.toFixed(4)}`, area.x, area.y + 6, area.w);
  const box = { x: area.x + 4, y: area.y + 18, w: area.w - 8, h: area.h - 22 };
  const { points } = lossPoints(state.history, box, state.total);
  ctx.strokeStyle = "#60a5fa";
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  points.forEach(([x, y], i) => (i ? ctx.lineTo(x, y) : ctx.moveTo(x, y)));
  ctx.stroke();
  ctx.restore();
}

function nodeById(id) {
  return app.graph?.getNodeById(Number(id)) ?? app.graph?.getNodeById(id) ?? null;
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
      node.setDirtyCanvas?.(true, false);
      app.graph.setDirtyCanvas?.(true, false);
    });
  },
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData.name !== "SegCkptTrainLoRA") return;
    addBottomPanel(nodeType, () => HEIGHT, draw);
    const onNodeCreated = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function () {
      const result = onNodeCreated?.apply(this, arguments);
      fitHeight(this);
      return result;
    };
  },
});
