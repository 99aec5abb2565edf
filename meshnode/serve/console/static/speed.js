// The speed view: rates between consecutive polls of `/metrics`, kept for a few minutes and
// drawn as small charts.
//
// Every figure is a difference of counters between two polls, so it describes that interval
// only: tokens/s, mean time to first token of the requests that got their first token then,
// compute of each stage and wire time per pipeline pass, and speculation acceptance of the
// requests that finished then. An interval with nothing to measure is a gap, not a zero.

import { metric } from "./api.js";
import { drawChart, stageColor } from "./charts.js";
import { fill, fmtMs, fmtNum, fmtPct, h } from "./ui.js";

/** Seconds of history the charts show (a few minutes, as the issue asks). */
export const HISTORY_S = 300;

const M = {
  tokens: "meshnode_generation_tokens_total",
  ttftSum: "meshnode_time_to_first_token_seconds_sum",
  ttftCount: "meshnode_time_to_first_token_seconds_count",
  passes: "meshnode_stage_compute_seconds_count",
  wire: "meshnode_wire_seconds_sum",
  stage: "meshnode_stage_seconds_total",
  inFlight: "meshnode_requests_in_flight",
  waiting: "meshnode_requests_waiting",
  proposed: "meshnode_spec_proposed_tokens_total",
  accepted: "meshnode_spec_accepted_tokens_total",
  windows: "meshnode_spec_windows_total",
};

const CHARTS = [
  { id: "tps", title: "Tokens / s", unit: (v) => fmtNum(v, v >= 10 ? 0 : 1) },
  { id: "ttft", title: "Time to first token", unit: fmtMs },
  { id: "pass", title: "Time per pass by stage", unit: fmtMs, stacked: true },
  { id: "requests", title: "Requests in flight / waiting", unit: (v) => fmtNum(v, 0),
    integer: true },
  { id: "accept", title: "Speculation: drafts accepted", unit: fmtPct },
  { id: "tpv", title: "Speculation: tokens per verify pass", unit: (v) => fmtNum(v, 1) },
];

/** Rates of one interval between two metric samples ({t, m}); null fields: not measured. */
export function interval(prev, cur) {
  const dt = cur.t - prev.t;
  const d = (name, labels) => (metric(cur.m, name, labels) ?? 0) - (metric(prev.m, name, labels) ?? 0);
  const passes = d(M.passes);
  const ttftCount = d(M.ttftCount);
  const proposed = d(M.proposed);
  const windows = d(M.windows);
  const stages = (cur.m[M.stage] || []).map((series) => series.labels.stage)
    .sort((a, b) => Number(a) - Number(b));
  return {
    t: cur.t,
    tps: dt > 0 ? d(M.tokens) / dt : null,
    ttft: ttftCount > 0 ? d(M.ttftSum) / ttftCount : null,
    stageCompute: stages.map((stage) => (passes > 0 ? d(M.stage, { stage }) / passes : null)),
    wire: passes > 0 ? d(M.wire) / passes : null,
    inFlight: metric(cur.m, M.inFlight),
    waiting: metric(cur.m, M.waiting),
    accept: proposed > 0 ? d(M.accepted) / proposed : null,
    tpv: windows > 0 ? (d(M.accepted) + windows) / windows : null,
  };
}

/** Polled samples and the intervals between them, bounded to the history window. */
export class SpeedHistory {
  constructor() {
    this.last = null;
    this.points = [];
  }

  add(t, metrics) {
    const sample = { t, m: metrics };
    if (this.last) this.points.push(interval(this.last, sample));
    this.last = sample;
    while (this.points.length && this.points[0].t < t - HISTORY_S) this.points.shift();
  }

  latest(field) {
    for (let i = this.points.length - 1; i >= 0; i--) {
      const value = this.points[i][field];
      if (value !== null && value !== undefined) return value;
    }
    return null;
  }
}

export function buildSpeed() {
  fill("speed-charts", CHARTS.map((chart) => h("figure", { class: "chart", id: `chart-${chart.id}` },
    h("figcaption", {}, h("span", {}, chart.title), h("strong", { id: `now-${chart.id}` }, "–")),
    h("canvas", { id: `canvas-${chart.id}` }),
    h("div", { class: "legend", id: `legend-${chart.id}` }))));
}

export function renderSpeed(history, status, now) {
  const pts = history.points;
  const line = (field, color) => ({ color, points: pts.map((p) => [p.t, p[field]]) });
  const stages = pts.length ? pts[pts.length - 1].stageCompute.length : 0;
  const passSeries = [];
  for (let i = 0; i < stages; i++) {
    passSeries.push({ color: stageColor(i), points: pts.map((p) => [p.t, p.stageCompute[i] ?? null]) });
  }
  passSeries.push({ color: "var(--wire)", points: pts.map((p) => [p.t, p.wire]) });
  const series = {
    tps: [line("tps", "var(--accent)")],
    ttft: [line("ttft", "var(--accent)")],
    pass: passSeries,
    requests: [line("inFlight", "var(--accent)"), line("waiting", "#e15759")],
    accept: [line("accept", "var(--accent)")],
    tpv: [line("tpv", "var(--accent)")],
  };
  for (const chart of CHARTS) {
    const data = series[chart.id].map((s) => ({ ...s, color: resolveColor(s.color) }));
    drawChart(document.getElementById(`canvas-${chart.id}`), data,
      { now, windowS: HISTORY_S, format: chart.unit, stacked: chart.stacked,
        integer: chart.integer });
  }
  renderNow(history, stages);
  renderLegends(history, stages, status);
}

function resolveColor(color) {
  const match = /^var\((--[\w-]+)\)$/.exec(color);
  return match ? getComputedStyle(document.documentElement).getPropertyValue(match[1]).trim() : color;
}

function renderNow(history, stages) {
  const set = (id, text) => { document.getElementById(`now-${id}`).textContent = text; };
  set("tps", fmtNum(history.latest("tps"), 1));
  set("ttft", fmtMs(history.latest("ttft")));
  const last = history.points.length ? history.points[history.points.length - 1] : null;
  const wire = history.latest("wire");
  let compute = null;
  for (let i = history.points.length - 1; i >= 0 && compute === null; i--) {
    const p = history.points[i];
    if (p.wire !== null && p.stageCompute.length === stages) compute = p.stageCompute.reduce((a, b) => a + (b ?? 0), 0);
  }
  // Short enough for the caption: "116 + 7.8 ms" (compute of all stages + wire).
  set("pass", compute === null ? "–" : `${fmtMs(compute).replace(" ms", "")} + ${fmtMs(wire)}`);
  document.getElementById("now-pass").title = "compute of all stages + wire time, per pass";
  set("requests", last ? `${last.inFlight ?? 0} / ${last.waiting ?? 0}` : "–");
  set("accept", fmtPct(history.latest("accept")));
  set("tpv", fmtNum(history.latest("tpv"), 2));
}

function renderLegends(history, stages, status) {
  const nodes = status.host?.stages || [];
  const key = (color, text) => h("span", {}, h("i", { class: "swatch", style: `background:${color}` }), text);
  const pass = [];
  for (let i = 0; i < stages; i++) {
    pass.push(key(stageColor(i), `stage ${i}${nodes[i] ? ` · ${nodes[i].node_id.slice(0, 8)}` : ""}`));
  }
  pass.push(key(resolveColor("var(--wire)"), "wire"));
  fill("legend-pass", pass);
  const peak = Math.max(0, ...history.points.map((p) => p.tps ?? 0));
  fill("legend-tps", h("span", { class: "muted" }, "peak ",
    h("b", { id: "peak-tps" }, fmtNum(peak, 1)), ` tok/s in ${HISTORY_S / 60} min`));
  fill("legend-requests", key(resolveColor("var(--accent)"), "in flight"), key("#e15759", "waiting"));
  const spec = status.host?.speculation;
  const strategy = spec ? `strategy ${spec.strategy}` : "";
  const total = spec?.acceptance;
  const drafted = total && total.proposed > 0;
  fill("legend-accept", h("span", { class: "muted" }, drafted
    ? `${strategy}; all requests: ${fmtPct(total.accept_rate)} of ${total.proposed} drafts`
    : `${strategy}; no drafts yet`));
  fill("legend-tpv", h("span", { class: "muted" }, drafted
    ? `all requests: ${fmtNum(total.tokens_per_verify, 2)} over ${total.windows} verify passes` : ""));
}
