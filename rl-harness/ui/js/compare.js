// Comparing runs: the config diff of selected runs (only the keys that differ), the list of
// sweeps, and a sweep's ranking with a parallel-coordinates view of its parameters against the
// chosen metric.

import { api, el, fmtNum, fmtValue, statusPill, show, errorBox } from "./util.js";

export async function compareView(runsText) {
  const ids = runsText.split(",").filter((x) => x.trim());
  const d = await api(`/api/diff?${ids.map((i) => `run=${encodeURIComponent(i)}`).join("&")}`);
  const head = el("tr", {}, el("th", {}, "config key"),
    ...d.runs.map((r) => el("th", {}, el("a", { href: `#/run/${r.id}` }, `#${r.id} ${r.name}`), " ", statusPill(r.status))));
  const rows = d.rows.map((row) => el("tr", {}, el("td", { class: "key" }, row.key),
    ...row.values.map((v) => el("td", { class: v === null ? "muted" : "" }, v === null ? "(unset)" : fmtValue(v)))));
  show(
    el("p", { class: "crumbs" }, el("a", { href: "#/" }, "runs"), " / compare"),
    el("h1", {}, `Config diff of ${d.runs.length} runs`),
    el("section", { class: "panel" },
      d.rows.length === 0 ? el("p", { id: "diff-identical" }, "Their configs are identical.")
        : [el("p", { class: "muted" }, `${d.rows.length} keys differ; the keys they share are left out.`),
          el("table", { id: "diff", class: "plain diff" }, el("thead", {}, head), el("tbody", {}, ...rows))]));
}

export async function sweepsView() {
  const { sweeps } = await api("/api/sweeps");
  show(el("h1", {}, "Sweeps"), el("section", { class: "panel" }, sweeps.length === 0
    ? el("p", { class: "muted" }, "No sweeps in this store (harness sweep FILE starts one).")
    : el("table", { class: "plain", id: "sweeps" }, el("thead", {}, el("tr", {}, ...["sweep", "name", "trials", "ranked by"].map((h) => el("th", {}, h)))),
      el("tbody", {}, ...sweeps.map((s) => el("tr", {}, el("td", {}, el("a", { href: `#/sweep/${encodeURIComponent(s.id)}` }, s.id)),
        el("td", {}, s.name), el("td", { class: "num" }, String(s.trials)), el("td", {}, s.metric || "val/test_score")))))));
}

/** Parallel coordinates on a canvas: one axis per parameter and one for the metric, one line
 * per trial coloured by its metric (best = dark). */
function parallel(params, trials, metric, maximise) {
  const canvas = el("canvas", { id: "parallel", width: "900", height: "320" });
  const done = trials.filter((t) => t.best !== null);
  const axes = [...params, metric];
  const value = (t, a) => (a === metric ? t.best : t.params[a]);
  // a few distinct values (a grid) sit evenly spaced in order; many numbers on a linear scale
  const scales = axes.map((a) => {
    const vs = done.map((t) => value(t, a));
    const numeric = vs.every((v) => typeof v === "number");
    const distinct = [...new Set(vs.map(fmtValue))];
    if (numeric && (a === metric || distinct.length > 8)) {
      const lo = Math.min(...vs), hi = Math.max(...vs);
      return { pos: (v) => (hi === lo ? 0.5 : (v - lo) / (hi - lo)), ticks: [lo, hi].map(fmtNum) };
    }
    const cats = numeric ? [...new Set(vs)].sort((x, y) => x - y).map(fmtValue) : distinct.sort();
    return { pos: (v) => (cats.length === 1 ? 0.5 : cats.indexOf(fmtValue(v)) / (cats.length - 1)), ticks: cats };
  });
  const draw = () => {
    const w = canvas.parentElement ? Math.max(480, canvas.parentElement.clientWidth - 8) : 900;
    canvas.width = w;
    const ctx = canvas.getContext("2d");
    const h = canvas.height, top = 36, bottom = h - 40, left = 70, right = w - 70;
    const x = (i) => (axes.length === 1 ? (left + right) / 2 : left + (i * (right - left)) / (axes.length - 1));
    const y = (p) => bottom - p * (bottom - top);
    ctx.clearRect(0, 0, w, h);
    ctx.font = "12px system-ui, sans-serif";
    const ms = done.map((t) => t.best);
    const lo = Math.min(...ms), hi = Math.max(...ms);
    const goodness = (t) => { const q = hi === lo ? 1 : (t.best - lo) / (hi - lo); return maximise ? q : 1 - q; };
    // the best trials drawn last, darkest and widest
    for (const t of [...done].sort((a, b) => goodness(a) - goodness(b))) {
      const good = goodness(t);
      ctx.strokeStyle = `hsla(222, 70%, ${72 - 42 * good}%, 0.9)`;
      ctx.lineWidth = 1.2 + 2 * good;
      ctx.beginPath();
      axes.forEach((a, i) => { const py = y(scales[i].pos(value(t, a))); i ? ctx.lineTo(x(i), py) : ctx.moveTo(x(i), py); });
      ctx.stroke();
    }
    ctx.fillStyle = "#222";
    ctx.strokeStyle = "#444";
    ctx.lineWidth = 1;
    axes.forEach((a, i) => {
      ctx.beginPath(); ctx.moveTo(x(i), top); ctx.lineTo(x(i), bottom); ctx.stroke();
      ctx.textAlign = "center";
      ctx.font = a === metric ? "bold 12px system-ui, sans-serif" : "12px system-ui, sans-serif";
      ctx.fillText(a, x(i), top - 14);
      ctx.font = "11px system-ui, sans-serif";
      const ticks = scales[i].ticks;
      ticks.forEach((tk, j) => {
        const p = ticks.length === 1 ? 0.5 : j / (ticks.length - 1);
        const last = i === axes.length - 1;
        ctx.textAlign = last ? "left" : "right";
        const tx = x(i) + (last ? 6 : -6), tw = ctx.measureText(tk).width;
        ctx.fillStyle = "rgba(255,255,255,0.85)";
        ctx.fillRect(last ? tx - 2 : tx - tw - 2, y(p) - 8, tw + 4, 15);
        ctx.fillStyle = "#222";
        ctx.fillText(tk, tx, y(p) + 4);
      });
    });
  };
  requestAnimationFrame(draw);
  return canvas;
}

export async function sweepView(id, metric) {
  const q = metric ? `?metric=${encodeURIComponent(metric)}` : "";
  const s = await api(`/api/sweep/${encodeURIComponent(id)}${q}`);
  const input = el("input", { id: "sweep-metric", value: s.metric, size: "32",
    onkeydown: (e) => { if (e.key === "Enter") location.hash = `#/sweep/${encodeURIComponent(id)}?metric=${encodeURIComponent(e.target.value)}`; } });
  const ranked = s.trials.map((t, i) => el("tr", {},
    el("td", { class: "num" }, t.best === null ? "–" : String(i + 1)), el("td", {}, t.trial), el("td", {}, t.state),
    el("td", {}, t.run === null ? "–" : el("a", { href: `#/run/${t.run}` }, `#${t.run}`)),
    el("td", { class: "num" }, fmtNum(t.best)), ...s.params.map((p) => el("td", {}, fmtValue(t.params[p])))));
  const withValue = s.trials.filter((t) => t.best !== null).length;
  show(
    el("p", { class: "crumbs" }, el("a", { href: "#/sweeps" }, "sweeps"), " / ", s.id),
    el("h1", {}, `Sweep ${s.id}`),
    el("section", { class: "panel" }, el("label", {}, "rank by ", input, " "),
      el("span", { class: "muted" }, `best value per trial, ${s.maximise ? "higher" : "lower"} is better; Enter to re-rank`)),
    el("section", { class: "panel" }, el("h2", {}, "Parameters against the metric"),
      withValue === 0 ? errorBox(`No trial has recorded ${s.metric} yet.`)
        : [el("p", { class: "muted" }, `One line per trial through its parameters to its best ${s.metric}; darker and thicker is better.`),
          parallel(s.params, s.trials, s.metric, s.maximise)]),
    el("section", { class: "panel" }, el("h2", {}, "Ranking"),
      el("table", { id: "ranking", class: "plain" }, el("thead", {}, el("tr", {},
        ...["rank", "trial", "state", "run", `best ${s.metric}`, ...s.params].map((h, i) => el("th", { class: i === 0 || i === 4 ? "num" : "" }, h)))), el("tbody", {}, ...ranked))));
}
