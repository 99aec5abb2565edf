// The mesh view: the nodes as a picture, each node's facts, the plan as a bar of layers
// coloured by stage, preparation progress, and the run's story (state, last failure, the
// nodes cooling off after blame).

import { stageColor } from "./charts.js";
import { fill, fmtBytes, fmtDuration, h, s } from "./ui.js";

const BOX = { w: 188, h: 58 };
const ROW_H = 74; // vertical room per peer in the picture

/** Everything the view needs, derived from one `/v1/mesh/status` body. */
export function meshModel(status) {
  const host = status.host || null;
  const stages = host ? host.stages : [];
  const stageOf = new Map(stages.map((st, i) => [st.node_id, i]));
  const hostId = host ? status.node.node_id : status.run?.coordinator || null;
  const self = {
    node_id: status.node.node_id, address: status.node.listen, device: status.node.device,
    usable_memory: status.node.usable_memory, state: "this node", rtt_ms: null, self: true,
  };
  const nodes = [self, ...status.peers];
  const role = (id) => {
    const parts = [];
    if (id === hostId) parts.push("host");
    if (stageOf.has(id)) parts.push(`stage ${stageOf.get(id)}`);
    else if (!host && id === self.node_id && status.run) parts.push("stage");
    return parts.join(" · ") || "idle";
  };
  return { host, stages, stageOf, hostId, nodes, role, cooling: coolingOff(host) };
}

/** The nodes blamed for a stage failure that no plan uses yet, soonest back first:
 *  [[node_id, seconds left], …] (the host's `cooling_off`; none on a worker). */
export function coolingOff(host) {
  return Object.entries(host?.cooling_off || {}).filter(([, left]) => left > 0)
    .sort(([a, x], [b, y]) => x - y || a.localeCompare(b));
}

/** Seconds left as `4m 48s` or `12s` (as `meshnode status` writes them). */
export function fmtCountdown(seconds) {
  const whole = Math.ceil(seconds);
  if (whole < 60) return `${whole}s`;
  return `${Math.floor(whole / 60)}m ${String(whole % 60).padStart(2, "0")}s`;
}

export function renderMesh(status) {
  const model = meshModel(status);
  fill("mesh-graph", graph(model));
  fill("mesh-nodes", nodeTable(model));
  fill("mesh-plan", planSection(status, model));
  fill("mesh-story", story(status, model));
}

// -- the picture ------------------------------------------------------------------------

function graph(model) {
  const [self, ...peers] = model.nodes;
  const height = Math.max(ROW_H, peers.length * ROW_H) + 16;
  // Drawn at the container's own width, so that text keeps its size on any screen.
  const width = Math.max(480, document.getElementById("mesh-graph").clientWidth || 640);
  const selfPos = { x: 24, y: height / 2 - BOX.h / 2 };
  const hops = workerHops(model, peers);
  const right = hops.length ? HOP_MARGIN : 24; // room right of the peers for their hops
  const peerPos = peers.map((_, i) => ({ x: width - BOX.w - right, y: 8 + i * ROW_H + (ROW_H - BOX.h) / 2 }));
  const svg = s("svg", { viewBox: `0 0 ${width} ${height}`, width, height, role: "img",
    "aria-label": "nodes of the mesh and their links" });
  peers.forEach((peer, i) => svg.append(link(selfPos, peerPos[i], peer)));
  hops.forEach(([st, from, to]) => svg.append(hopArc(st, peerPos[from], peerPos[to])));
  svg.append(nodeBox(self, selfPos, model));
  peers.forEach((peer, i) => svg.append(nodeBox(peer, peerPos[i], model)));
  if (!peers.length) {
    svg.append(s("text", { x: width / 2 + 60, y: height / 2, class: "muted",
      "text-anchor": "middle", text: "no peers yet: start `meshnode join` on another machine" }));
  }
  return svg;
}

function link(a, b, peer) {
  const x1 = a.x + BOX.w;
  const y1 = a.y + BOX.h / 2;
  const x2 = b.x;
  const y2 = b.y + BOX.h / 2;
  const rtt = peer.rtt_ms === null ? "rtt –" : `${peer.rtt_ms.toFixed(2)} ms`;
  const label = peer.link_mbytes_per_s ? `${rtt} · ${fmtLink(peer.link_mbytes_per_s)}` : rtt;
  const cls = `link state-${peer.state}${peer.connected ? "" : " disconnected"}`;
  const mx = (x1 + x2) / 2;
  const my = (y1 + y2) / 2;
  const half = peer.link_mbytes_per_s ? 64 : 34;
  return s("g", { class: cls },
    s("line", { x1, y1, x2, y2 }),
    s("rect", { x: mx - half, y: my - 10, width: 2 * half, height: 20, rx: 10, class: "link-label-bg" }),
    s("text", { x: mx, y: my + 4, "text-anchor": "middle", class: "link-label", text: label }));
}

const HOP_MARGIN = 112; // px right of the peers: a hop's arc and its label

/** The plan's hops between two workers (issue 34): [stage, index of the peer it comes
 *  from, index of the stage's peer] for each stage whose hop does not start at the host. */
function workerHops(model, peers) {
  const index = new Map(peers.map((peer, i) => [peer.node_id, i]));
  return model.stages.filter((st) => st.hop_from && st.hop_from !== model.hostId)
    .filter((st) => index.has(st.hop_from) && index.has(st.node_id))
    .map((st) => [st, index.get(st.hop_from), index.get(st.node_id)]);
}

// A hop between two workers as an arc right of their boxes, labelled with the link's rate
// as the two reported it (else the host's link to the stage's node, as the planner counts).
function hopArc(st, a, b) {
  const x = a.x + BOX.w;
  const [y1, y2] = [a.y + BOX.h / 2, b.y + BOX.h / 2];
  const bend = x + 40; // the arc reaches 3/4 of this: the label starts right of it
  const rate = st.link_mbytes_per_s ? fmtLink(st.link_mbytes_per_s) : "not measured";
  return s("g", { class: "hop-link", "data-from": st.hop_from, "data-to": st.node_id },
    s("title", { text: `hop ${st.hop_from} → ${st.node_id}: ${st.hop_ms.toFixed(2)} ms a token` }),
    s("path", { d: `M ${x} ${y1} C ${bend} ${y1}, ${bend} ${y2}, ${x} ${y2}` }),
    s("text", { x: x + 36, y: (y1 + y2) / 2 + 4, class: "link-label", text: rate }));
}

function nodeBox(node, pos, model) {
  const stage = model.stageOf.get(node.node_id);
  const accent = stage === undefined ? "var(--border)" : stageColor(stage);
  const facts = `${node.device} · ${fmtBytes(node.usable_memory)}`;
  return s("g", { class: `node state-${node.state.replace(" ", "-")}`,
    transform: `translate(${pos.x},${pos.y})`, "data-node-id": node.node_id },
    s("title", { text: `${node.node_id} at ${node.address}` }),
    s("rect", { width: BOX.w, height: BOX.h, rx: 8, class: "node-box" }),
    s("rect", { width: 6, height: BOX.h, rx: 3, fill: accent }),
    s("circle", { cx: BOX.w - 12, cy: 12, r: 4.5, class: "state-dot" }),
    s("text", { x: 16, y: 20, class: "node-id", text: node.node_id }),
    s("text", { x: 16, y: 36, class: "node-role", text: model.role(node.node_id) }),
    s("text", { x: 16, y: 50, class: "node-facts", text: facts }));
}

// -- the table of nodes -------------------------------------------------------------------

function nodeTable(model) {
  const cooling = new Map(model.cooling);
  const rows = model.nodes.map((node) => h("tr", { "data-node-id": node.node_id },
    h("td", { class: "mono" }, node.node_id),
    h("td", {}, model.role(node.node_id)),
    h("td", { class: "mono" }, node.address),
    h("td", {}, node.device),
    h("td", { class: "num" }, fmtBytes(node.usable_memory)),
    h("td", {}, h("span", { class: `pill state-${node.state.replace(" ", "-")}` }, node.state),
      cooling.has(node.node_id) ? coolingPill(cooling.get(node.node_id)) : null),
    h("td", { class: "num" }, node.rtt_ms === null ? "–" : `${node.rtt_ms.toFixed(2)} ms`),
    h("td", { class: "num link-rate", title: "this node's link to the peer, measured by a probe" },
      node.link_mbytes_per_s ? fmtLink(node.link_mbytes_per_s) : "–")));
  return h("table", { class: "grid" },
    h("thead", {}, h("tr", {}, ...["node", "role", "address", "device", "memory offered",
      "state", "rtt", "link"].map((t) => h("th", {}, t)))),
    h("tbody", {}, rows));
}

function coolingPill(seconds) {
  return h("span", { class: "pill state-cooling-off", title: "blamed for a stage failure: "
    + "no plan uses this node until its cool-off ends" }, `cooling off ${fmtCountdown(seconds)}`);
}

// -- the plan -----------------------------------------------------------------------------

function planSection(status, model) {
  if (!model.host) return workerPlan(status);
  const stages = model.stages;
  if (!stages.length) {
    return h("p", { class: "muted" }, `No plan yet (${model.host.state}). ${model.host.error || ""}`);
  }
  const layers = stages[stages.length - 1].layers[1];
  const bar = h("div", { class: "planbar", id: "plan-bar", "data-layers": layers },
    stages.map((st, i) => h("div", {
      class: "segment", "data-stage": i, "data-node-id": st.node_id,
      "data-layers": `${st.layers[0]}-${st.layers[1]}`,
      style: `flex-grow:${Math.max(st.layers[1] - st.layers[0], 0.5)};background:${stageColor(i)}`,
      title: `stage ${i}: layers ${st.layers[0]}–${st.layers[1] - 1} on ${st.node_id}`,
    }, `${st.layers[0]}–${st.layers[1] - 1}`)));
  const legend = h("table", { class: "grid stages" },
    h("thead", {}, h("tr", {}, ...["stage", "node", "layers", "parts", "memory", "state",
      "preparation", "decode", "hop"].map((t) => h("th", {}, t)))),
    h("tbody", {}, stages.map((st, i) => stageRow(st, i))));
  const title = `${model.host.model_id} · ${layers} layers on ${stages.length} stage${stages.length > 1 ? "s" : ""}`;
  return [h("div", { class: "plan-title" }, title), placement(model.host), bar, legend];
}

// What the split follows (issue 34): measured speeds, or memory with the calibration's
// outcome (a failed one says why).
function placement(host) {
  if (!host.placed_by) return null;
  const by = host.placed_by === "speed" ? "placed by measured speed" : "placed by memory";
  const offloaded = (host.stages || []).filter((st) => st.offload_bytes > 0)
    .map((st) => `${st.node_id} reads ${fmtBytes(st.offload_bytes)} of its layers from disk`);
  const warning = offloaded.length ? ` · memory is short: ${offloaded.join(", ")}` : "";
  const measured = (host.stages || []).filter((st) => st.self_measured)
    .map((st) => `${st.node_id}: ${selfMeasured(st.self_measured)}`);
  const own = measured.length ? ` · measured by each node: ${measured.join("; ")}` : "";
  return h("p", { class: "muted", id: "placement" },
    `${by} · calibration: ${host.calibration || "–"}${warning}${own}`);
}

// What a node measured of itself as it prepared (µs per layer per token), or why not.
function selfMeasured(m) {
  if (m.error) return `– (${m.error}: planned by memory)`;
  const disk = m.disk_mb_s ? `, disk ${m.disk_mb_s} MB/s` : "";
  return `${m.decode_us} µs/layer decode (8 rows ${m.batch8_us}, prefill ${m.prefill_us})${disk}`;
}

function stageRow(st, i) {
  const parts = [st.embed && "embed", st.head && "head"].filter(Boolean).join(" + ") || "–";
  const count = st.layers[1] - st.layers[0];
  return h("tr", { "data-stage": i },
    h("td", {}, h("span", { class: "swatch", style: `background:${stageColor(i)}` }), ` ${i}`),
    h("td", { class: "mono" }, st.node_id),
    h("td", {}, `${st.layers[0]}–${st.layers[1] - 1} (${count})`),
    h("td", {}, parts),
    h("td", { class: "num" }, fmtBytes(st.memory_bytes)),
    h("td", {}, h("span", { class: `pill state-${st.state}` }, st.state)),
    h("td", {}, progress(st.bytes_done, st.bytes_total)),
    h("td", { class: "num", title: "weight bytes a second, one row a pass (measured)" },
      st.decode_bytes_per_s ? `${(st.decode_bytes_per_s / 1e6).toFixed(0)} MB/s` : "–"),
    hop(st));
}

// The hop into a stage from the one before (issue 34), as `meshnode status`'s HOP IN: a
// token's time, the node it comes from and the link it crosses (a prefill chunk's time in
// the title), as the planner counts them; stage 0 has none.
function hop(st) {
  if (st.hop_ms === undefined || st.hop_ms === null) return h("td", { class: "num hop" }, "–");
  const link = st.link_mbytes_per_s ? fmtLink(st.link_mbytes_per_s) : "link not measured yet";
  return h("td", { class: "num hop", "data-hop-from": st.hop_from,
    title: `prefill chunk: ${st.prefill_hop_ms} ms; the round trip plus the activations `
      + `over the link from ${st.hop_from} to ${st.node_id} (into stage 1: the host's own `
      + "measurement; between two workers: the one they reported, else the host's link)" },
  `${st.hop_ms.toFixed(2)} ms from ${st.hop_from} · ${link}`);
}

/** A link's measured rate (MB/s in the status) as `118 MB/s` or `1.2 GB/s`. */
export function fmtLink(mbytesPerS) {
  if (mbytesPerS >= 1000) return `${(mbytesPerS / 1000).toFixed(1)} GB/s`;
  return `${mbytesPerS >= 10 ? mbytesPerS.toFixed(0) : mbytesPerS.toFixed(2)} MB/s`;
}

function progress(done, total) {
  if (!total) return h("span", { class: "muted" }, "–");
  // A stage that reads local files reports a token total of one byte: nothing to fetch.
  if (total <= 1 && done >= total) return h("span", { class: "muted" }, "local files");
  const ratio = Math.min(1, done / total);
  return h("div", { class: "progress", title: `${fmtBytes(done)} of ${fmtBytes(total)}` },
    h("div", { class: "progress-fill", style: `width:${(ratio * 100).toFixed(1)}%` }),
    h("span", {}, `${(ratio * 100).toFixed(0)}% of ${fmtBytes(total)}`));
}

function workerPlan(status) {
  const run = status.run;
  if (!run) return h("p", { class: "muted" }, "This node holds no stage: no host has claimed it.");
  const layers = run.layers ? `layers ${run.layers[0]}–${run.layers[run.layers.length - 1]}` : "its layers";
  return [
    h("p", {}, `This node runs ${layers} for host `, h("span", { class: "mono" }, run.coordinator),
      ` (${run.run_id}, term ${run.term}): `, h("span", { class: `pill state-${run.state}` }, run.state)),
    run.bytes_total ? progress(run.bytes_done, run.bytes_total) : null,
    run.error ? h("p", { class: "error" }, run.error) : null,
    h("p", { class: "muted" }, "The whole plan is shown by the host's console."),
  ];
}

// -- the run's story ------------------------------------------------------------------------

function story(status, model) {
  const items = [h("li", {}, `Node up ${fmtDuration(status.node.uptime_s)}, mesh “${status.node.mesh_name}”, `
    + `${status.peers.filter((p) => p.state === "alive").length} peer(s) alive.`)];
  const host = model.host;
  if (host) {
    // Terms only grow (they start from the wall clock), so they order runs but count nothing.
    items.push(h("li", { title: `term ${host.term}` }, `Run ${host.run_id || "–"} is `,
      h("span", { class: `pill state-${host.state}` }, host.state), "."));
    if (host.error) items.push(h("li", { class: "error" }, `Now: ${host.error}`));
    if (host.last_failure) {
      const now = host.state === "ready" ? ` The mesh replanned: ${host.run_id} serves now.` : "";
      items.push(h("li", { class: "warn", id: "last-failure" }, `Last failure: ${host.last_failure}.${now}`));
    } else {
      items.push(h("li", { class: "muted" }, "No failure since the node started."));
    }
    if (model.cooling.length) {
      const nodes = model.cooling.map(([id, left]) => `${id} ${fmtCountdown(left)}`).join(", ");
      items.push(h("li", { class: "warn", id: "cooling-off" }, `Cooling off: ${nodes} `
        + "(blamed for a stage failure; no plan uses them until then)."));
    }
    for (const warning of host.speculation?.warnings || []) {
      items.push(h("li", { class: "warn" }, `Speculation: ${warning}`));
    }
  }
  items.push(...poolLines(status));
  const errors = status.node.protocol_errors + status.node.internal_errors;
  if (errors || status.node.refused_handshakes) {
    items.push(h("li", { class: "warn" }, `${status.node.refused_handshakes} refused handshake(s), `
      + `${status.node.protocol_errors} protocol error(s), ${status.node.internal_errors} internal error(s).`));
  }
  return h("ul", { class: "story" }, items);
}

// The prefix pool of each stage this node runs (issue 30): blocks in use, cached, free.
export function poolLines(status) {
  const parts = [["stage 0", status.host?.kv], ["its stage", status.run?.kv]];
  return parts.filter(([, kv]) => kv && kv.prefix_blocks_total !== undefined).map(([role, kv]) =>
    h("li", { class: "pool", "data-role": role }, `Prefix cache (${role}): `
      + `${kv.prefix_blocks_used} blocks used, ${kv.prefix_blocks_cached} cached, `
      + `${kv.prefix_blocks_free} free of ${kv.prefix_blocks_total} (${kv.prefix_block_tokens} tokens each); `
      + `${kv.prefix_hit_tokens} prompt tokens reused, ${kv.prefix_miss_tokens} computed.`));
}
