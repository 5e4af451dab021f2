// The chart panel of the runs view: a searchable list of metric keys, and one uPlot chart per
// chosen metric overlaying the selected runs (x by step or by wall time since the run's first
// record, EMA smoothing, log scale, and a min/max band with the mean for runs grouped together).

import { api, el, colour } from "./util.js";
import { saveState } from "./state.js";

/** TensorBoard's EMA (as `harness compare --smooth`): weight 0 leaves the series as it is. */
export function smooth(values, weight) {
  if (!(weight > 0)) return values;
  let acc = null;
  return values.map((v) => {
    if (v === null || !Number.isFinite(v)) return v;
    acc = acc === null ? v : weight * acc + (1 - weight) * v;
    return acc;
  });
}

/** Aligns per-line (xs, ys) onto the sorted union of their xs, null where a line has no point. */
export function align(lines) {
  const xs = [...new Set(lines.flatMap((l) => l.xs))].sort((a, b) => a - b);
  const at = new Map(xs.map((x, i) => [x, i]));
  const ys = lines.map((l) => {
    const out = new Array(xs.length).fill(null);
    l.xs.forEach((x, i) => { out[at.get(x)] = l.ys[i]; });
    return out;
  });
  return [xs, ...ys];
}

/** Per x, the min, mean and max of the non-null values of `rows` (aligned arrays). */
function envelope(rows, n) {
  const lo = [], mid = [], hi = [];
  for (let i = 0; i < n; i++) {
    const vs = rows.map((r) => r[i]).filter((v) => v !== null && Number.isFinite(v));
    if (vs.length === 0) { lo.push(null); mid.push(null); hi.push(null); continue; }
    lo.push(Math.min(...vs));
    hi.push(Math.max(...vs));
    mid.push(vs.reduce((a, b) => a + b, 0) / vs.length);
  }
  return { lo, mid, hi };
}

export class ChartPanel {
  constructor(state, onChange) {
    this.state = state;
    this.onChange = onChange;
    this.keys = [];
    this.plots = new Map();
    this.root = el("section", { id: "charts", class: "panel" });
    window.harnessUi.charts = this.plots;
  }

  /** The runs (rows of /api/runs) selected, in table order. */
  selectedRuns() {
    return this.state.runs.filter((r) => this.state.selected.has(r.id));
  }

  async render() {
    const runs = this.selectedRuns();
    if (runs.length === 0) {
      saveState();
      this.destroy();
      this.root.replaceChildren(el("p", { class: "muted" },
        "Tick runs in the table to chart their metrics."));
      return;
    }
    const ids = runs.map((r) => r.id);
    try {
      this.keys = (await api(`/api/keys?run=${ids.join(",")}`)).keys;
    } catch (e) {
      this.root.replaceChildren(el("div", { class: "error" }, e.message));
      return;
    }
    if (this.state.metrics.length === 0) {
      const main = runs.map((r) => r.metric_key).find((k) => k && this.keys.includes(k));
      if (main) this.state.metrics = [main];
    }
    this.root.replaceChildren(this.controls(), el("div", { class: "chart-body" },
      this.keyList(), el("div", { id: "chart-grid", class: "chart-grid" })));
    await this.draw();
  }

  controls() {
    const s = this.state;
    const smoothLabel = el("span", { id: "smooth-label" }, s.smoothing > 0 ? `EMA ${s.smoothing.toFixed(2)}` : "off");
    // a band needs the grouped runs at shared x values: steps, not seconds since each start
    const grouped = s.group !== "none" && s.xaxis === "step";
    const why = s.group === "none" ? "Group the table (by project, sweep or name) to band runs together"
      : "Bands need the runs at the same x: pick step as the x axis";
    return el("div", { class: "controls" },
      el("label", {}, "x axis ",
        el("select", { id: "xaxis", onchange: (e) => { s.xaxis = e.target.value; this.render(); } },
          el("option", { value: "step", selected: s.xaxis === "step" }, "step"),
          el("option", { value: "time", selected: s.xaxis === "time" }, "wall time (s since start)"))),
      el("label", { title: "Exponential moving average, TensorBoard's weighting" }, "smoothing ",
        el("input", { id: "smoothing", type: "range", min: "0", max: "0.99", step: "0.01", value: String(s.smoothing),
          oninput: (e) => { s.smoothing = Number(e.target.value); smoothLabel.textContent = s.smoothing > 0 ? `EMA ${s.smoothing.toFixed(2)}` : "off"; this.draw(); } }),
        " ", smoothLabel),
      el("label", {}, el("input", { id: "logscale", type: "checkbox", checked: s.log,
        onchange: (e) => { s.log = e.target.checked; this.draw(); } }), " log scale"),
      el("label", { class: grouped ? "" : "disabled", title: grouped ? "" : why },
        el("input", { id: "band", type: "checkbox", checked: s.band && grouped, disabled: !grouped,
          onchange: (e) => { s.band = e.target.checked; this.draw(); } }),
        " min/max band per group"));
  }

  keyList() {
    const s = this.state;
    const list = el("ul", { id: "key-list", class: "key-list" });
    const fill = (needle) => {
      const chosen = s.metrics.filter((k) => this.keys.includes(k));
      const rest = this.keys.filter((k) => !s.metrics.includes(k) && k.toLowerCase().includes(needle));
      list.replaceChildren(...[...chosen, ...rest].slice(0, 400).map((k) => el("li", {},
        el("label", {}, el("input", { type: "checkbox", "data-key": k, checked: s.metrics.includes(k),
          onchange: (e) => {
            s.metrics = e.target.checked ? [...s.metrics, k] : s.metrics.filter((m) => m !== k);
            this.draw();
          } }), " ", k))));
    };
    const search = el("input", { id: "key-search", type: "search", placeholder: `search ${this.keys.length} metrics`,
      oninput: (e) => fill(e.target.value.toLowerCase()) });
    fill("");
    return el("div", { class: "keys" }, search, list);
  }

  destroy() {
    for (const p of this.plots.values()) p.destroy();
    this.plots.clear();
  }

  /** Fetches the chosen metrics of the selected runs and (re)draws every chart. */
  async draw() {
    saveState();
    const grid = this.root.querySelector("#chart-grid");
    if (!grid) return;
    const runs = this.selectedRuns();
    const metrics = this.state.metrics.filter((k) => this.keys.includes(k));
    if (metrics.length === 0) {
      this.destroy();
      grid.replaceChildren(el("p", { class: "muted" }, "Pick one or more metrics on the left."));
      return;
    }
    const q = runs.map((r) => `run=${r.id}`).concat(metrics.map((k) => `key=${encodeURIComponent(k)}`)).join("&");
    let series;
    try {
      series = (await api(`/api/series?${q}`)).series;
    } catch (e) {
      grid.replaceChildren(el("div", { class: "error" }, e.message));
      return;
    }
    this.destroy();
    grid.replaceChildren();
    for (const key of metrics) {
      const box = el("div", { class: "chart", "data-metric": key });
      grid.append(box);
      this.plots.set(key, this.plot(box, key, runs, series.filter((s) => s.key === key)));
    }
  }

  /** One metric's chart. */
  plot(box, key, runs, series) {
    const s = this.state;
    const byRun = new Map(series.map((x) => [x.run, x]));
    const lines = runs.map((r, i) => {
      const d = byRun.get(r.id) || { steps: [], times: [], values: [] };
      const t0 = d.times.length ? d.times[0] : 0;
      const xs = s.xaxis === "time" ? d.times.map((t) => Math.round((t - t0) * 1000) / 1000) : d.steps;
      let ys = smooth(d.values, s.smoothing);
      if (s.log) ys = ys.map((v) => (v !== null && v > 0 ? v : null));
      return { run: r, xs, ys, colour: colour(i) };
    });
    const data = align(lines);
    const n = data[0].length;
    const ema = s.smoothing > 0 ? ` (EMA ${s.smoothing.toFixed(2)})` : "";
    const uSeries = [{ label: s.xaxis === "time" ? "seconds" : "step" }];
    const bands = [];
    const groups = new Map();
    if (s.band && s.group !== "none" && s.xaxis === "step") {
      lines.forEach((l, i) => {
        const g = this.state.groupOf(l.run);
        if (!groups.has(g)) groups.set(g, []);
        groups.get(g).push(i);
      });
    }
    const out = [data[0]];
    const banded = new Set([...groups.values()].filter((m) => m.length > 1).flat());
    lines.forEach((l, i) => {
      if (banded.has(i)) return;
      out.push(data[i + 1]);
      uSeries.push({ label: `#${l.run.id} ${l.run.name}${ema}`, stroke: l.colour, width: 1.5,
        spanGaps: true, points: { show: l.xs.length < 2 }, "run": l.run.id });
    });
    for (const [g, members] of groups) {
      if (members.length < 2) continue;
      const c = colour(members[0]);
      const env = envelope(members.map((i) => data[i + 1]), n);
      const base = out.length;
      out.push(env.hi, env.mid, env.lo);
      const quiet = { width: 1, spanGaps: true, points: { show: false } };
      uSeries.push({ ...quiet, label: `${g} max`, stroke: c + "55" },
        { label: `${g}: mean of ${members.length}${ema}`, stroke: c, width: 2, spanGaps: true, points: { show: false } },
        { ...quiet, label: `${g} min`, stroke: c + "55" });
      bands.push({ series: [base, base + 2], fill: c + "22" });
    }
    const width = Math.max(320, box.clientWidth || 600);
    const opts = {
      title: key + (s.log ? " (log scale)" : ""),
      width, height: 260,
      series: uSeries,
      bands,
      scales: { x: { time: false }, y: s.log ? { distr: 3 } : {} },
      axes: [{ label: s.xaxis === "time" ? "wall time since the run's first record (s)" : "step", labelSize: 20, size: 36 },
        { size: 60 }],
      legend: { live: true },
      cursor: { drag: { x: true, y: false } },
    };
    const u = new uPlot(opts, out, box);
    u.runIds = uSeries.slice(1).map((x) => x.run ?? null);
    return u;
  }
}
