// Gradient Checkpointing Schedule node: draws its effective per-block plan as a strip of cells
// per block list, from GET /segckpt/plan (the engine's plan; one source of truth), refreshed when
// a widget changes, in a results widget below the node's widgets (segckpt_canvas.js). Blocks whose
// frozen weights stream from host memory get a band in the stream colour along their top. Every
// colour and label comes with the plan (its marks and stream_marks), none is declared here.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { addResultsWidget, fillText, fitHeight } from "./segckpt_canvas.js";
import {
  FALLBACK_COLOR, linkedTrainInput, markStyle, OFFLOAD_KEYS, planQuery, SCHEDULE_KEYS, STREAM_KEYS, stripLayout,
  TINY_PRESET, widgetValue,
} from "./segckpt_common.js";

const ROW = 12, GAP = 3, LEGEND_ROW = 14, HEADER = 16, BAND = 4;

function panelHeight(node) {
  const state = node.segckpt;
  if (!state?.plan) return HEADER + 2 * LEGEND_ROW;
  const lists = Object.keys(state.plan.block_map).length;
  const legend = Math.ceil(stripLayout(state.plan, 100).legend.length / 2);
  return HEADER + lists * (ROW + GAP) + legend * LEGEND_ROW + 8;
}

function currentQuery(node) {
  const values = { family: widgetValue(node, "family") };
  for (const key of SCHEDULE_KEYS) values[key] = widgetValue(node, key);
  const offload = linkedTrainInput(node, "offload"); // Train LoRA applies its keys over ours
  if (offload) for (const key of OFFLOAD_KEYS) values[key] = widgetValue(offload, key) ?? values[key];
  const weights = linkedTrainInput(node, "weight_offload"); // and then the weight offload node's
  if (weights) {
    for (const key of STREAM_KEYS) {
      const value = widgetValue(weights, key);
      if (value !== undefined) values[key] = value;
    }
  }
  const loader = linkedTrainInput(node, "model");
  const size = widgetValue(loader, "source") === TINY_PRESET ? "tiny" : "full";
  return { query: planQuery(values, size), loaderFamily: widgetValue(loader, "family"), offload: !!offload };
}

async function refresh(node, query) {
  const state = node.segckpt;
  try {
    const response = await api.fetchApi(`/segckpt/plan?${query}`);
    const body = await response.json();
    if (state.query !== query) return; // a newer request superseded this one
    state.error = response.ok ? null : body.error ?? `HTTP ${response.status}`;
    state.plan = response.ok ? body : null;
  } catch (error) {
    state.error = String(error);
    state.plan = null;
  }
  fitHeight(node);
}

// a band in a stream mark's colour along the top of a streamed block's cell (or legend swatch)
function drawStreamBand(ctx, x, y, w, color) {
  ctx.fillStyle = color;
  ctx.fillRect(x, y, w, BAND);
}

function draw(node, ctx, area) {
  const state = (node.segckpt ??= { query: null, plan: null, error: null, timer: null });
  const { query, loaderFamily, offload } = currentQuery(node);
  if (query !== state.query) {
    state.query = query;
    clearTimeout(state.timer);
    state.timer = setTimeout(() => refresh(node, query), 150);
  }
  ctx.save();
  ctx.font = "11px sans-serif";
  ctx.textBaseline = "middle";
  ctx.fillStyle = "#a1a1aa";
  const family = widgetValue(node, "family");
  let header = state.plan ? `plan: ${state.plan.mode}, ${state.plan.size} ${state.plan.family}` : "plan: …";
  if (state.plan?.streamed_blocks > 0) header += " (weights streamed)";
  if (state.plan && offload) header += " (with the offload options)";
  if (loaderFamily && family && loaderFamily !== family) {
    header = `model is ${loaderFamily}: set family to match`;
    ctx.fillStyle = "#f87171";
  }
  if (state.error) {
    ctx.fillStyle = "#f87171";
    header = state.error;
  }
  fillText(ctx, header, area.x, area.y + HEADER / 2, area.w);
  if (state.plan && !state.error) {
    const layout = stripLayout(state.plan, area.w, { label: 64, row: ROW, gap: GAP });
    for (const row of layout.rows) {
      const y = area.y + HEADER + row.y;
      ctx.fillStyle = "#d4d4d8";
      fillText(ctx, row.name, area.x, y + ROW / 2, 60);
      for (const cell of row.cells) {
        ctx.fillStyle = markStyle(state.plan, cell.mark).color;
        ctx.fillRect(area.x + cell.x, y, cell.w, ROW);
        if (cell.stream) drawStreamBand(ctx, area.x + cell.x, y, cell.w, markStyle(state.plan, cell.stream, true).color);
      }
    }
    const top = area.y + HEADER + layout.height + 4;
    layout.legend.forEach(({ mark, stream }, i) => {
      const x = area.x + (i % 2) * (area.w / 2);
      const y = top + Math.floor(i / 2) * LEGEND_ROW;
      const style = markStyle(state.plan, mark, stream);
      ctx.fillStyle = stream ? style.base ?? FALLBACK_COLOR : style.color; // a stream mark: a block with the band
      ctx.fillRect(x, y + 3, 9, 9);
      if (stream) drawStreamBand(ctx, x, y + 3, 9, style.color);
      ctx.fillStyle = "#d4d4d8";
      fillText(ctx, style.label, x + 13, y + 8, area.w / 2 - 16);
    });
  }
  ctx.restore();
}

app.registerExtension({
  name: "segckpt.ScheduleStrip",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData.name !== "SegCkptSchedule") return;
    addResultsWidget(nodeType, "segckpt_plan_strip", panelHeight, draw);
  },
});
