// The runs view: the filter box (the language of `harness runs --filter`, errors inline), the
// sortable, groupable runs table with its selection, and the chart panel under it.

import { api, el, fmtNum, fmtTime, fmtDuration, statusPill, show } from "./util.js";
import { ChartPanel } from "./chart.js";
import { saveState } from "./state.js";

const COLUMNS = [
  ["status", "status", (r) => r.status],
  ["project", "project", (r) => r.project],
  ["name", "run", (r) => r.name],
  ["algorithm", "algorithm", (r) => r.algorithm],
  ["step", "steps", (r) => r.step],
  ["duration", "duration", (r) => r.duration_s],
  ["metric", "main metric", (r) => r.metric],
  ["started", "started", (r) => r.started ?? r.created],
];

export class RunsView {
  constructor(state) {
    this.state = state;
    state.groupOf = (r) => this.groupOf(r);
    this.charts = new ChartPanel(state);
    this.error = el("div", { id: "filter-error", class: "error", role: "alert", hidden: true });
    this.count = el("span", { id: "run-count", class: "muted" });
    this.table = el("table", { id: "runs", class: "runs" });
    this.compareBtn = el("button", { id: "compare", disabled: true,
      onclick: () => { location.hash = `#/compare?runs=${[...state.selected].join(",")}`; } }, "Compare configs");
  }

  /** The group a run belongs to under the current grouping ("" when none). */
  groupOf(r) {
    switch (this.state.group) {
      case "project": return r.project;
      case "sweep": return r.sweep ? (this.state.sweeps[r.sweep] || r.sweep) : "(no sweep)";
      case "name": return r.name;
      default: return "";
    }
  }

  async mount() {
    const s = this.state;
    let timer = null;
    const input = el("input", { id: "filter", type: "search", spellcheck: "false", autocomplete: "off", value: s.filter,
      placeholder: "filter, as harness runs --filter: status = 'running' or (trainer.algorithm = 'on_policy' and val/test_score > 0.5)",
      oninput: (e) => { clearTimeout(timer); timer = setTimeout(() => this.applyFilter(e.target.value), 300); },
      onkeydown: (e) => { if (e.key === "Enter") { clearTimeout(timer); this.applyFilter(e.target.value); } } });
    const group = el("select", { id: "group", onchange: (e) => { s.group = e.target.value; this.renderTable(); this.charts.render(); } },
      ...["none", "project", "sweep", "name"].map((g) => el("option", { value: g, selected: s.group === g }, g === "none" ? "no grouping" : `group by ${g}`)));
    show(
      el("section", { class: "panel" },
        el("div", { class: "filter-row" }, input),
        this.error,
        el("div", { class: "toolbar" }, this.count, group, this.compareBtn,
          el("button", { id: "clear", onclick: () => { s.selected.clear(); s.metrics = []; this.renderTable(); this.charts.render(); } }, "Clear selection"))),
      el("section", { class: "panel table-wrap" }, this.table),
      this.charts.root);
    await this.refresh();
    await this.charts.render();
  }

  async applyFilter(text) {
    this.state.filter = text;
    saveState();
    await this.refresh();
    await this.charts.render();
  }

  /** Re-reads the runs (live); redraws the table, and the charts when a charted run runs. */
  async refresh(live = false) {
    const s = this.state;
    const q = s.filter.trim() ? `?filter=${encodeURIComponent(s.filter)}` : "";
    let body;
    try {
      body = await api(`/api/runs${q}`);
    } catch (e) {
      this.error.textContent = e.message;
      this.error.hidden = false;
      document.getElementById("filter")?.classList.add("bad");
      this.count.textContent = "filter not applied: the table still shows the previous list";
      this.table.parentElement?.classList.add("stale");
      return;
    }
    this.error.hidden = true;
    document.getElementById("filter")?.classList.remove("bad");
    this.table.parentElement?.classList.remove("stale");
    const wasRunning = s.runs.some((r) => s.selected.has(r.id) && r.status === "running");
    s.runs = body.runs;
    s.sweeps = body.sweeps;
    const shown = new Set(s.runs.map((r) => r.id));
    for (const id of [...s.selected]) if (!shown.has(id)) s.selected.delete(id);
    this.count.textContent = body.runs.length === body.total
      ? `${body.total} runs` : `${body.runs.length} of ${body.total} runs match`;
    this.renderTable();
    if (live && wasRunning) await this.charts.draw();
  }

  sorted(runs) {
    const s = this.state;
    const col = COLUMNS.find((c) => c[0] === s.sort.col);
    const get = col ? col[2] : (r) => r.id;
    return [...runs].sort((a, b) => {
      const x = get(a), y = get(b);
      if (x === y) return b.id - a.id;
      if (x === null || x === undefined) return 1;
      if (y === null || y === undefined) return -1;
      return (x < y ? -1 : 1) * s.sort.dir;
    });
  }

  renderTable() {
    const s = this.state;
    const head = el("tr", {}, el("th", { class: "check" }),
      ...COLUMNS.map(([key, label]) => el("th", { "data-col": key, class: "sortable",
        title: `sort by ${label}`,
        onclick: () => { s.sort = { col: key, dir: s.sort.col === key ? -s.sort.dir : (key === "name" || key === "project" ? 1 : -1) }; this.renderTable(); } },
        label, s.sort.col === key ? (s.sort.dir > 0 ? " ▲" : " ▼") : "")));
    const rows = this.sorted(s.runs);
    const body = el("tbody");
    const groups = new Map();
    for (const r of rows) {
      const g = this.groupOf(r);
      if (!groups.has(g)) groups.set(g, []);
      groups.get(g).push(r);
    }
    for (const [g, members] of groups) {
      if (s.group !== "none") {
        const all = members.every((r) => s.selected.has(r.id));
        body.append(el("tr", { class: "group" }, el("td", { class: "check" },
          el("input", { type: "checkbox", checked: all, title: "select the group",
            onchange: (e) => { for (const r of members) e.target.checked ? s.selected.add(r.id) : s.selected.delete(r.id); this.selectionChanged(); } })),
          el("td", { colspan: String(COLUMNS.length) }, el("span", { class: "muted" }, `${s.group} `), g,
            el("span", { class: "muted" }, ` · ${members.length} run${members.length === 1 ? "" : "s"}`))));
      }
      for (const r of members) body.append(this.row(r));
    }
    if (rows.length === 0) {
      body.append(el("tr", {}, el("td", { colspan: String(COLUMNS.length + 1), class: "muted empty" },
        s.filter.trim() ? "No run matches the filter." : "The store has no runs yet.")));
    }
    this.table.replaceChildren(el("thead", {}, head), body);
    this.compareBtn.disabled = s.selected.size < 2;
    this.compareBtn.title = s.selected.size < 2 ? "select two or more runs" : "";
  }

  row(r) {
    const s = this.state;
    return el("tr", { "data-run": String(r.id), class: s.selected.has(r.id) ? "selected" : "" },
      el("td", { class: "check" }, el("input", { type: "checkbox", "data-run": String(r.id), checked: s.selected.has(r.id),
        "aria-label": `select run ${r.id}`,
        onchange: (e) => { e.target.checked ? s.selected.add(r.id) : s.selected.delete(r.id); this.selectionChanged(); } })),
      el("td", {}, statusPill(r.status)),
      el("td", {}, r.project),
      el("td", { class: "name" }, el("a", { href: `#/run/${r.id}`, title: r.error || "" }, el("span", { class: "muted" }, `#${r.id} `), r.name)),
      el("td", {}, r.algorithm),
      el("td", { class: "num" }, r.step ?? "–"),
      el("td", { class: "num" }, fmtDuration(r.duration_s)),
      el("td", { class: "num", title: r.metric_key || "" }, r.metric_key
        ? [fmtNum(r.metric), el("span", { class: "muted small" }, ` ${r.metric_key}`)] : "–"),
      el("td", {}, fmtTime(r.started ?? r.created)));
  }

  selectionChanged() {
    this.renderTable();
    this.charts.render();
  }
}
