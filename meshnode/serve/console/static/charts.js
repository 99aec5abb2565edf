// Small time-series charts on a <canvas>, hand-written: lines, or stacked areas.
//
// A chart shows the last `windowS` seconds; points are [unixSeconds, value], and a null
// value is a gap (nothing was measured then). Colours come from the page's CSS variables,
// so charts follow the light or dark scheme.

const PAD = { right: 8, top: 8, bottom: 18, label: 6 }; // the left one fits the labels

/** Stage colours, shared by the plan bar and the per-stage charts. */
export const STAGE_COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948",
  "#e15759", "#9c755f"];

export function stageColor(index) {
  return STAGE_COLORS[index % STAGE_COLORS.length];
}

function cssVar(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}

/** A "nice" axis maximum at or above `value` (1, 2 or 5 times a power of ten). */
export function niceMax(value) {
  if (!(value > 0)) return 1;
  const power = 10 ** Math.floor(Math.log10(value));
  for (const step of [1, 2, 5, 10]) {
    if (value <= step * power) return step * power;
  }
  return 10 * power;
}

function setup(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth;
  const height = canvas.clientHeight;
  if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  return { ctx, width, height };
}

function drawAxes(ctx, box, max, format, windowS) {
  ctx.strokeStyle = cssVar("--grid");
  ctx.fillStyle = cssVar("--muted");
  ctx.lineWidth = 1;
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (let i = 0; i <= 2; i++) {
    const y = box.y + box.h - (box.h * i) / 2;
    ctx.beginPath();
    ctx.moveTo(box.x, Math.round(y) + 0.5);
    ctx.lineTo(box.x + box.w, Math.round(y) + 0.5);
    ctx.stroke();
    ctx.fillText(i ? format((max * i) / 2) : "0", box.x - PAD.label, y);
  }
  ctx.textBaseline = "top";
  ctx.textAlign = "left";
  ctx.fillText(`−${Math.round(windowS / 60)} min`, box.x, box.y + box.h + 4);
  ctx.textAlign = "right";
  ctx.fillText("now", box.x + box.w, box.y + box.h + 4);
}

/**
 * Draw `series` ([{color, points}]) on `canvas`: lines, or with `stacked` filled areas
 * each on top of the previous ones. `format(v)` labels the y axis.
 */
export function drawChart(canvas, series,
  { now, windowS, format = String, stacked = false, integer = false }) {
  const { ctx, width, height } = setup(canvas);
  const layers = stacked ? stack(series) : series.map((s) => s.points);
  let top = 0;
  for (const points of layers) {
    for (const [, v] of points) if (v !== null && v > top) top = v;
  }
  // Counts get an even maximum, so that the middle grid line is a whole number too.
  const max = integer ? Math.max(2, 2 * Math.ceil(niceMax(top) / 2)) : niceMax(top);
  ctx.font = "11px system-ui, sans-serif";
  const labelWidth = Math.max(...[0.5, 1].map((f) => ctx.measureText(format(max * f)).width));
  const left = Math.ceil(labelWidth) + 2 * PAD.label;
  const box = { x: left, y: PAD.top, w: width - left - PAD.right, h: height - PAD.top - PAD.bottom };
  drawAxes(ctx, box, max, format, windowS);
  const x = (t) => box.x + box.w * (1 - (now - t) / windowS);
  const y = (v) => box.y + box.h * (1 - v / max);
  layers.forEach((points, i) => {
    const color = series[i].color;
    if (stacked) fillLayer(ctx, points, i > 0 ? layers[i - 1] : null, x, y, color);
    else strokeLine(ctx, points, x, y, color);
  });
}

function strokeLine(ctx, points, x, y, color) {
  ctx.strokeStyle = color;
  ctx.lineWidth = 1.75;
  ctx.beginPath();
  let open = false;
  for (const [t, v] of points) {
    if (v === null) {
      open = false;
      continue;
    }
    if (open) ctx.lineTo(x(t), y(v));
    else ctx.moveTo(x(t), y(v));
    open = true;
  }
  ctx.stroke();
  // A lone point between gaps would be invisible as a line.
  ctx.fillStyle = color;
  points.forEach(([t, v], i) => {
    const lonely = v !== null && (points[i - 1]?.[1] ?? null) === null &&
      (points[i + 1]?.[1] ?? null) === null;
    if (lonely) ctx.fillRect(x(t) - 1.5, y(v) - 1.5, 3, 3);
  });
}

/** Cumulative sums of the series, point by point (all series share their timestamps). */
function stack(series) {
  const out = [];
  series.forEach((s, i) => {
    out.push(s.points.map(([t, v], j) => {
      const below = i > 0 ? out[i - 1][j][1] : 0;
      return [t, v === null || below === null ? null : below + v];
    }));
  });
  return out;
}

function fillLayer(ctx, points, below, x, y, color) {
  ctx.fillStyle = color;
  ctx.globalAlpha = 0.85;
  let run = [];
  const flush = () => {
    if (run.length) {
      ctx.beginPath();
      run.forEach(([t, v], k) => (k ? ctx.lineTo(x(t), y(v)) : ctx.moveTo(x(t), y(v))));
      for (let k = run.length - 1; k >= 0; k--) ctx.lineTo(x(run[k][0]), y(run[k][2]));
      ctx.closePath();
      ctx.fill();
    }
    run = [];
  };
  points.forEach(([t, v], j) => {
    if (v === null) return flush();
    run.push([t, v, below ? below[j][1] : 0]);
  });
  flush();
  ctx.globalAlpha = 1;
}
