// The console's driver: tabs, the poll loop over `/v1/mesh/status` and `/metrics`, the
// header, and the API key dialog.

import { ApiError, AuthError, apiKey, getJSON, getMetrics, setApiKey } from "./api.js";
import { renderMesh } from "./mesh.js";
import { Playground } from "./playground.js";
import { buildSpeed, renderSpeed, SpeedHistory } from "./speed.js";
import { fill, h } from "./ui.js";

// One poll a second: fine enough for the charts, and two small GETs a second cost the node
// nothing next to a forward pass.
const POLL_MS = 1000;
const TABS = ["mesh", "speed", "playground"];

const speed = new SpeedHistory();
let playground = null;
let waitingForKey = false;
let polling = false; // a slow node must not pile up overlapping polls
let isHost = false;

function showTab(name) {
  if (!TABS.includes(name) || (name === "playground" && !isHost)) name = "mesh";
  for (const tab of TABS) {
    document.getElementById(`view-${tab}`).hidden = tab !== name;
    document.getElementById(`tab-${tab}`).setAttribute("aria-selected", String(tab === name));
  }
  if (location.hash !== `#${name}`) window.history.replaceState(null, "", `#${name}`);
}

function askForKey(reason) {
  waitingForKey = true;
  document.getElementById("key-reason").textContent = reason || "This node requires an API key.";
  document.getElementById("key-input").value = apiKey();
  document.getElementById("key-dialog").hidden = false;
  document.getElementById("key-input").focus();
}

function setupKeyDialog() {
  document.getElementById("key-button").addEventListener("click", () => askForKey(
    "The key is sent as `Authorization: Bearer` with every request of this page and kept in "
    + "this browser only."));
  document.getElementById("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    setApiKey(document.getElementById("key-input").value.trim());
    document.getElementById("key-dialog").hidden = true;
    waitingForKey = false;
    poll();
  });
  document.getElementById("key-cancel").addEventListener("click", () => {
    document.getElementById("key-dialog").hidden = true;
    waitingForKey = false;
  });
}

function renderHeader(status) {
  const host = status.host;
  const state = host ? host.state : status.run ? status.run.state : "idle";
  fill("header-facts",
    h("span", {}, "mesh ", h("b", {}, status.node.mesh_name)),
    h("span", {}, "node ", h("b", { class: "mono", id: "self-id" }, status.node.node_id)),
    host ? h("span", {}, "model ", h("b", {}, host.model_id)) : h("span", {}, "worker"),
    h("span", { class: `pill state-${state}` }, state));
  document.title = `meshnode · ${host ? host.model_id : status.node.node_id}`;
}

function setHost(status) {
  isHost = Boolean(status.host);
  document.getElementById("tab-playground").hidden = !isHost;
  document.getElementById("speed-none").hidden = isHost;
  document.getElementById("speed-charts").hidden = !isHost;
  if (isHost) playground.setModel(status.host.model_id);
}

function banner(text) {
  const el = document.getElementById("banner");
  el.hidden = !text;
  el.textContent = text || "";
}

async function poll() {
  if (waitingForKey || polling) return;
  polling = true;
  try {
    const status = await getJSON("v1/mesh/status");
    const metrics = status.host ? await getMetrics() : null;
    const now = Date.now() / 1000;
    setHost(status);
    renderHeader(status);
    renderMesh(status);
    if (metrics) {
      speed.add(now, metrics);
      if (!document.getElementById("view-speed").hidden) renderSpeed(speed, status, now);
    }
    document.body.dataset.loaded = "true";
    banner("");
  } catch (err) {
    if (err instanceof AuthError) askForKey(`The node refused the request: ${err.message}`);
    else banner(err instanceof ApiError ? `Cannot read the node: ${err.message}` : String(err));
  } finally {
    polling = false;
  }
}

function main() {
  buildSpeed();
  playground = new Playground((reason) => askForKey(reason));
  setupKeyDialog();
  for (const tab of TABS) {
    document.getElementById(`tab-${tab}`).addEventListener("click", () => {
      showTab(tab);
      poll();
    });
  }
  window.addEventListener("hashchange", () => showTab(location.hash.slice(1)));
  poll().then(() => showTab(location.hash.slice(1)));
  setInterval(poll, POLL_MS);
}

main();
