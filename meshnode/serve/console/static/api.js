// The node's own API, as the console uses it: the API key, JSON and text reads, the
// Prometheus text parsed into numbers, and a streamed chat completion.
//
// Everything goes to the origin that served the page (relative URLs), so the console works
// offline and behind a path prefix. The key lives in this browser's localStorage only.

const KEY_STORAGE = "meshnode.apiKey";

/** Raised for a 401/403 so that the page can ask for a key. */
export class AuthError extends Error {}

/** Raised for any other failed request; `status` is the HTTP status (0: unreachable). */
export class ApiError extends Error {
  constructor(message, status) {
    super(message);
    this.status = status;
  }
}

export function apiKey() {
  return localStorage.getItem(KEY_STORAGE) || "";
}

export function setApiKey(key) {
  if (key) localStorage.setItem(KEY_STORAGE, key);
  else localStorage.removeItem(KEY_STORAGE);
}

function headers(extra = {}) {
  const key = apiKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

async function request(path, init = {}) {
  let response;
  try {
    response = await fetch(path, { ...init, headers: headers(init.headers), cache: "no-store" });
  } catch (err) {
    throw new ApiError(`the node does not answer (${err.message})`, 0);
  }
  if (response.status === 401 || response.status === 403) {
    throw new AuthError(await errorText(response));
  }
  if (!response.ok) throw new ApiError(await errorText(response), response.status);
  return response;
}

async function errorText(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    return body.error?.message || body.detail || text;
  } catch {
    return text || `HTTP ${response.status}`;
  }
}

export async function getJSON(path) {
  return (await request(path)).json();
}

/** `/metrics` as {name: [{labels, value}]}; null when this node serves no model (404). */
export async function getMetrics() {
  try {
    return parseMetrics(await (await request("metrics")).text());
  } catch (err) {
    if (err instanceof ApiError && err.status === 404) return null;
    throw err;
  }
}

/** Parse the Prometheus text format (the subset meshnode writes). */
export function parseMetrics(text) {
  const out = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const match = /^([a-zA-Z_:][\w:]*)(\{([^}]*)\})?\s+(\S+)$/.exec(line);
    if (!match) continue;
    const labels = {};
    for (const pair of (match[3] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) {
      labels[pair[1]] = pair[2];
    }
    (out[match[1]] ||= []).push({ labels, value: Number(match[4]) });
  }
  return out;
}

/** The value of one series (labels must all match), or the sum of all when none given. */
export function metric(metrics, name, labels = null) {
  const series = metrics?.[name];
  if (!series) return null;
  if (!labels) return series.reduce((sum, s) => sum + s.value, 0);
  const found = series.find((s) => Object.entries(labels).every(([k, v]) => s.labels[k] === v));
  return found ? found.value : null;
}

/**
 * Stream `/v1/chat/completions`: `onText(text)` per content delta; resolves to the final
 * chunk's `meshnode` block (speculation and timings) and the finish reason.
 */
export async function streamChat(body, onText, signal) {
  const response = await request("v1/chat/completions", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
    signal,
  });
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  // firstAt/endAt: when the first text and the end arrived (ms, for the reply's speed).
  const result = { telemetry: null, finish: null, usage: null, firstAt: null, endAt: null };
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) {
      result.endAt = performance.now();
      break;
    }
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      handleEvent(event, onText, result);
    }
  }
  return result;
}

function handleEvent(event, onText, result) {
  for (const line of event.split("\n")) {
    if (!line.startsWith("data:")) continue;
    const data = line.slice(5).trim();
    if (data === "[DONE]") return;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new ApiError(chunk.error.message, 500);
    const choice = chunk.choices?.[0];
    if (choice?.delta?.content) {
      result.firstAt ??= performance.now();
      onText(choice.delta.content);
    }
    if (choice?.finish_reason) result.finish = choice.finish_reason;
    if (chunk.meshnode) result.telemetry = chunk.meshnode;
    if (chunk.usage) result.usage = chunk.usage;
  }
}
