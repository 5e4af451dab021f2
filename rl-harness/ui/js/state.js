// What the runs view shows (filter, sort, grouping, selected runs, charted metrics and chart
// settings), kept across routes and mirrored in the address (#/?filter=...&runs=1,2&metric=...),
// so a view can be bookmarked, shared or reloaded as it was.

export const state = {
  filter: "", sort: { col: "started", dir: -1 }, group: "none", selected: new Set(),
  metrics: [], smoothing: 0, xaxis: "step", log: false, band: true, runs: [], sweeps: {},
};

/** Sets the state from the runs view's address parameters (those present). */
export function loadState(params) {
  if (params.has("filter")) state.filter = params.get("filter");
  if (params.has("group")) state.group = params.get("group");
  if (params.has("runs")) state.selected = new Set(params.get("runs").split(",").map(Number).filter((n) => n > 0));
  if (params.has("metric")) state.metrics = params.getAll("metric");
  if (params.has("smooth")) state.smoothing = Math.min(0.99, Math.max(0, Number(params.get("smooth")) || 0));
  if (params.has("x")) state.xaxis = params.get("x") === "time" ? "time" : "step";
  if (params.has("log")) state.log = params.get("log") === "1";
  if (params.has("band")) state.band = params.get("band") !== "0";
}

/** Writes the state into the address without a new history entry or a re-route. */
export function saveState() {
  const p = new URLSearchParams();
  if (state.filter.trim()) p.set("filter", state.filter);
  if (state.group !== "none") p.set("group", state.group);
  if (state.selected.size) p.set("runs", [...state.selected].join(","));
  for (const m of state.metrics) p.append("metric", m);
  if (state.smoothing > 0) p.set("smooth", String(state.smoothing));
  if (state.xaxis !== "step") p.set("x", state.xaxis);
  if (state.log) p.set("log", "1");
  if (!state.band) p.set("band", "0");
  const q = p.toString();
  history.replaceState(null, "", `#/${q ? `?${q}` : ""}`);
}
