// Pure helpers of the pack's frontend: no DOM, no ComfyUI imports, so node's test runner can load
// them (tests/js/). The node extensions (schedule_strip.js, train_loss_curve.js) draw with them.

/** The schedule keys, in the order of the Gradient Checkpointing Schedule node's widgets (the six, then save_attention). */
export const SCHEDULE_KEYS = [
  "gradient_checkpointing",
  "gradient_checkpointing_backend",
  "gradient_checkpointing_interval",
  "gradient_checkpointing_segment_stride",
  "gradient_checkpointing_offload_attention",
  "gradient_checkpointing_offload_pin_memory_max_buckets",
  "gradient_checkpointing_save_attention",
];

/**
 * The three weight-streaming keys, in the order of the Weight Offload Options node's widgets
 * (weight_offload_blocks 0 = all blocks).
 */
export const STREAM_KEYS = ["weight_offload", "weight_offload_blocks", "weight_offload_prefetch"];

/**
 * Fill colour of a mark the plan does not describe: a neutral black. The plan describes every
 * mark the engine emits (tests/core/test_marks.py), so the strip shows it only for a mismatch.
 */
export const FALLBACK_COLOR = "#000000";

/**
 * Colour and label of a mark, as the plan serves them (GET /segckpt/plan: `marks` for the block
 * map, `stream_marks` for the stream map; declared in engine/config/backends.py and
 * engine/config/backends.py, nowhere in the frontend).
 * @param {{marks?: Record<string, {color: string, label: string}>,
 *          stream_marks?: Record<string, {color: string, label: string, base?: string}>}} plan
 * @param {string} mark
 * @param {boolean} stream a stream-map mark (drawn as a band over the cell; `base`: the colour
 *     under the band in its legend swatch)
 * @returns {{color: string, label: string, base?: string}} FALLBACK_COLOR and the mark itself as
 *     label for a mark the plan does not describe
 */
export function markStyle(plan, mark, stream = false) {
  const styles = (stream ? plan?.stream_marks : plan?.marks) ?? {};
  return Object.hasOwn(styles, mark) ? styles[mark] : { color: FALLBACK_COLOR, label: mark };
}

export const TINY_PRESET = "(tiny preset)";

/**
 * Query string of GET /segckpt/plan for the schedule node's widget values (and the weight offload
 * node's, when one is linked).
 * @param {Record<string, unknown>} values widget name -> value (interval/stride 0 = unset;
 *     weight_offload_blocks 0 = all); a key that is absent is not sent (the engine's default)
 * @param {"full"|"tiny"} size reference model size
 * @returns {string} e.g. "family=flux&size=tiny&gradient_checkpointing=true&...&weight_offload_blocks=all"
 */
export function planQuery(values, size = "full") {
  const params = new URLSearchParams();
  params.set("family", String(values.family ?? ""));
  params.set("size", size);
  for (const key of [...SCHEDULE_KEYS, ...STREAM_KEYS]) {
    if (!(key in values) || values[key] === undefined) continue; // an optional widget the node lacks
    let value = values[key];
    if ((key.endsWith("_interval") || key.endsWith("_stride")) && Number(value) === 0) value = "";
    if (key === "weight_offload_blocks" && Number(value) === 0) value = "all";
    params.set(key, String(value));
  }
  return params.toString();
}

/**
 * Layout of the block strip: one row per block list, one cell per block.
 * @param {{block_map: Record<string, string>, stream_map?: Record<string, string>,
 *          marks?: Record<string, object>, stream_marks?: Record<string, object>}} plan the route's
 *     answer (stream_map: one character per block, a key of stream_marks where a band is drawn;
 *     empty or absent when nothing streams)
 * @param {number} width pixels available
 * @param {{label?: number, row?: number, gap?: number}} opts label column width, row height, gap
 * @returns {{rows: {name: string, y: number, cells: {x: number, w: number, mark: string,
 *            stream: string|null}[]}[], legend: {mark: string, stream: boolean}[], height: number}}
 *          cells in pixels relative to the strip's origin (stream: the cell's stream-map mark when
 *          it is drawn, else null); legend = the block marks present, in the order of plan.marks
 *          (marks it lacks last), then the stream marks present, in the order of plan.stream_marks.
 */
export function stripLayout(plan, width, opts = {}) {
  const label = opts.label ?? 64, row = opts.row ?? 14, gap = opts.gap ?? 4;
  const drawn = plan.stream_marks ?? {};
  const rows = [];
  const used = new Set(), streams = new Set();
  let y = 0;
  for (const [name, map] of Object.entries(plan.block_map ?? {})) {
    const n = map.length;
    const streamMap = plan.stream_map?.[name] ?? "";
    const span = Math.max(0, width - label);
    const cells = [];
    for (let i = 0; i < n; i++) {
      const x0 = label + Math.floor((i * span) / n);
      const x1 = label + Math.floor(((i + 1) * span) / n);
      const stream = Object.hasOwn(drawn, streamMap[i] ?? "") ? streamMap[i] : null;
      cells.push({ x: x0, w: Math.max(1, x1 - x0 - (span / n >= 4 ? 1 : 0)), mark: map[i], stream });
      used.add(map[i]);
      if (stream) streams.add(stream);
    }
    rows.push({ name, y, cells });
    y += row + gap;
  }
  const order = Object.keys(plan.marks ?? {});
  const marks = [...order.filter((m) => used.has(m)), ...[...used].filter((m) => !order.includes(m))];
  const legend = [...marks.map((mark) => ({ mark, stream: false })),
    ...Object.keys(drawn).filter((m) => streams.has(m)).map((mark) => ({ mark, stream: true }))];
  return { rows, legend, height: y };
}

/**
 * Append one `segckpt.loss` event to a loss history; a step that does not follow the last one
 * (a new run) starts a new history.
 * @param {{step: number, loss: number}[]} history
 * @param {{step: number, loss: number, total?: number}} detail
 * @returns {{step: number, loss: number}[]} the new history (the input is not changed)
 */
export function recordLoss(history, detail) {
  const last = history.length ? history[history.length - 1].step : 0;
  const base = detail.step > last ? history : [];
  return [...base, { step: detail.step, loss: detail.loss }];
}

/**
 * Polyline of the loss curve inside a box; non-finite losses are skipped.
 * @param {{step: number, loss: number}[]} history
 * @param {{x: number, y: number, w: number, h: number}} box pixels (y grows downwards)
 * @param {number} total steps of the run (x axis end); defaults to the last step
 * @returns {{points: [number, number][], min: number, max: number}}
 */
export function lossPoints(history, box, total) {
  const finite = history.filter((p) => Number.isFinite(p.loss));
  if (!finite.length) return { points: [], min: NaN, max: NaN };
  const min = Math.min(...finite.map((p) => p.loss));
  const max = Math.max(...finite.map((p) => p.loss));
  const end = Math.max(total ?? 0, finite[finite.length - 1].step, 2);
  const span = max - min || 1;
  const points = finite.map((p) => [
    box.x + ((p.step - 1) / (end - 1)) * box.w,
    box.y + box.h - ((p.loss - min) / span) * box.h,
  ]);
  return { points, min, max };
}

/** @typedef {{x: number, y: number, w: number, h: number}} Box a rectangle in pixels (y grows downwards) */

/** Heights (pixels) of the parts of Train LoRA's results (web/train_loss_curve.js). */
export const TRAIN_PANEL = { label: 16, curve: 72, gap: 6, note: 14, previewLabel: 16, preview: 92, spacing: 4 };

/**
 * Where Train LoRA draws its results, one part under the other in the space its results widget
 * reserves below the node's last widget: the step label, the loss curve's box, the notes (one
 * row per wrapped line), the previews' label and the previews (square, in rows that wrap at the
 * width).
 * @param {number} width pixels available
 * @param {number} notes lines of notes
 * @param {number} previews images
 * @returns {{label: Box, curve: Box, notes: Box[], previewLabel: Box|null, images: Box[], height: number}}
 *     boxes {x, y, w, h} relative to the results' top left corner, all inside width x height;
 *     height = what the widget reserves
 */
export function trainPanelLayout(width, notes, previews) {
  const P = TRAIN_PANEL;
  const label = { x: 0, y: 0, w: width, h: P.label };
  const curve = { x: 0, y: P.label, w: width, h: P.curve };
  let y = P.label + P.curve + P.gap;
  const rows = Array.from({ length: notes }, (_, i) => ({ x: 0, y: y + i * P.note, w: width, h: P.note }));
  y += notes * P.note;
  let previewLabel = null;
  const images = [];
  if (previews > 0) {
    previewLabel = { x: 0, y, w: width, h: P.previewLabel };
    y += P.previewLabel;
    const side = Math.max(1, Math.min(P.preview, width));
    const columns = Math.max(1, Math.floor((width + P.spacing) / (side + P.spacing)));
    for (let i = 0; i < previews; i++) {
      const row = Math.floor(i / columns), column = i % columns;
      images.push({ x: column * (side + P.spacing), y: y + row * (side + P.spacing), w: side, h: side });
    }
    y += Math.ceil(previews / columns) * (side + P.spacing) - P.spacing + P.gap;
  }
  return { label, curve, notes: rows, previewLabel, images, height: y };
}

/**
 * The node wired into input `name` of the Train node that this schedule node feeds, if any:
 * "model" gives the Load Diffusion Model node, "offload" the Activation Offload Options node,
 * "weight_offload" the Weight Offload Options node.
 * Uses only LiteGraph's getOutputNodes / getInputNode / inputs, present in every frontend.
 * @returns {object|null} that node, or null when not wired that way
 */
export function linkedTrainInput(scheduleNode, name) {
  for (const train of scheduleNode.getOutputNodes?.(0) ?? []) {
    const slot = (train.inputs ?? []).findIndex((input) => input.name === name);
    const node = slot >= 0 ? train.getInputNode?.(slot) : null;
    if (node) return node;
  }
  return null;
}

/** Offload keys an Activation Offload Options node overrides on the schedule. */
export const OFFLOAD_KEYS = SCHEDULE_KEYS.filter((key) => key.includes("backend") || key.includes("offload"));

/** Value of the widget called `name` on a node, or undefined. */
export function widgetValue(node, name) {
  return (node?.widgets ?? []).find((w) => w.name === name)?.value;
}

/** Node types that show their result text on the canvas after a run (node_text.js). */
export const TEXT_NODES = ["SegCkptRunReport", "SegCkptSchedulePlanner", "SegCkptSaveLoRA", "SegCkptSweep"];

/**
 * The lines of an `executed` message's text (or a list of lines), none left out.
 * @param {unknown} text the `ui.text` list (or one string) the node returned
 * @returns {string[]}
 */
export function textLines(text) {
  const joined = Array.isArray(text) ? text.join("\n") : String(text ?? "");
  return joined.split("\n");
}

/**
 * Lines wrapped to a width: a line breaks at spaces, or inside a long word after a `/`, `_`, `-`
 * or `.` (file names), else anywhere; a piece that continues a line is indented as that line plus
 * two spaces. Nothing is left out: the pieces, read in order, hold every character of the lines
 * but the spaces they broke at.
 * @param {string[]} lines
 * @param {number} width pixels (or characters) available
 * @param {(text: string) => number} measure the width of a text, in the same unit
 * @returns {string[]}
 */
export function wrapLines(lines, width, measure) {
  const out = [];
  for (const line of lines) {
    if (measure(line) <= width) {
      out.push(line);
      continue;
    }
    const indent = line.match(/^ */)[0];
    const more = indent + "  ";
    let current = indent, fresh = true;  // fresh: nothing on the current piece yet but its indent
    const push = () => {
      out.push(current);
      current = more;
      fresh = true;
    };
    line.slice(indent.length).split(/ +/).forEach((word, w) => {
      word.split(/(?<=[/_.-])/).forEach((part, i) => {
        const gap = w > 0 && i === 0 && !fresh ? " " : "";
        if (measure(current + gap + part) <= width) {
          current += gap + part;
          fresh = false;
          return;
        }
        if (!fresh) push();
        let rest = part;
        while (measure(current + rest) > width && rest.length > 1) {  // a part wider than a line
          let cut = rest.length - 1;
          while (cut > 1 && measure(current + rest.slice(0, cut)) > width) cut--;
          current += rest.slice(0, cut);
          rest = rest.slice(cut);
          push();
        }
        current += rest;
        fresh = false;
      });
    });
    if (!fresh) out.push(current);
  }
  return out;
}

/**
 * The `/view` URL (relative to the API root) of an output file the node reported.
 * @param {{filename: string, subfolder?: string, type?: string}} file
 * @returns {string} e.g. "/view?filename=step_00004_prompt0.png&subfolder=segckpt%2Frun_00001%2Fpreviews&type=output"
 */
export function previewUrl(file) {
  const params = new URLSearchParams({ filename: file.filename, subfolder: file.subfolder ?? "",
                                       type: file.type ?? "output" });
  return `/view?${params}`;
}

// Which frame of an animated preview shows `elapsed` ms after it started: frames of `durations`
// ms each, looping (the WebP loops forever). Canvas drawImage shows only the first frame of an
// animated image (HTML spec), so the node decodes the frames (WebCodecs ImageDecoder) and picks one.
export function frameAt(durations, elapsed) {
  const total = durations.reduce((sum, d) => sum + Math.max(d, 1), 0);
  if (!durations.length || !total) return 0;
  let t = ((elapsed % total) + total) % total;
  for (let i = 0; i < durations.length; i++) {
    t -= Math.max(durations[i], 1);
    if (t < 0) return i;
  }
  return durations.length - 1;
}
