// Small helpers shared by the views: fetching the JSON API, building DOM, formatting numbers,
// times and durations, and the run colours.

/** GETs an API view; throws an Error carrying the server's message on a non-2xx answer. */
export async function api(path) {
  const r = await fetch(path, { cache: "no-store" });
  let body;
  try {
    body = await r.json();
  } catch {
    throw new Error(`${path}: the server answered ${r.status} without JSON`);
  }
  if (!r.ok) throw new Error(body.error || `${path}: HTTP ${r.status}`);
  return body;
}

/** An element: el("td", { class: "x", onclick: f }, child, "text", ...). */
export function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else if (k === "text") e.textContent = v;
    else e.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

/** A number for a table: 4 significant-ish decimals, exponent form for tiny or huge ones. */
export function fmtNum(v) {
  if (v === null || v === undefined) return "–";
  if (typeof v !== "number") return String(v);
  if (!Number.isFinite(v)) return String(v);
  if (Number.isInteger(v) && Math.abs(v) < 1e6) return String(v);
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(3);
  return v.toFixed(4);
}

/** Unix seconds as local `YYYY-MM-DD HH:MM`. */
export function fmtTime(t) {
  if (t === null || t === undefined) return "–";
  const d = new Date(t * 1000);
  const p = (n) => String(n).padStart(2, "0");
  return `${d.getFullYear()}-${p(d.getMonth() + 1)}-${p(d.getDate())} ${p(d.getHours())}:${p(d.getMinutes())}`;
}

/** Seconds as `1h02m`, `3m05s`, `12s` (as `harness runs` prints them). */
export function fmtDuration(s) {
  if (s === null || s === undefined) return "–";
  s = Math.max(0, Math.round(s));
  const p = (n) => String(n).padStart(2, "0");
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m${p(s % 60)}s`;
  return `${Math.floor(s / 3600)}h${p(Math.floor((s % 3600) / 60))}m`;
}

/** A config value as text. */
export function fmtValue(v) {
  if (v === undefined) return "(unset)";
  if (typeof v === "string") return v;
  return JSON.stringify(v);
}

const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
  "#17becf", "#7f7f7f", "#bcbd22"];

/** The colour of the i-th series. */
export function colour(i) {
  return PALETTE[i % PALETTE.length];
}

/** A status pill. */
export function statusPill(status) {
  return el("span", { class: `pill status-${status}`, title: status }, status);
}

/** Replaces the children of the main view. */
export function show(...children) {
  const v = document.getElementById("view");
  v.replaceChildren(...children);
  return v;
}

/** An error box. */
export function errorBox(message) {
  return el("div", { class: "error", role: "alert" }, message);
}
