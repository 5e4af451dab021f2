// A run's page: what it is and how it ended, the command that resumes it, its final metrics,
// resolved config (one collapsible group per config group; groups at their defaults folded),
// checkpoints, events, and the validation generations it kept.

import { api, el, fmtNum, fmtTime, fmtDuration, fmtValue, statusPill, show } from "./util.js";

function table(id, head, rows, empty) {
  if (rows.length === 0) return el("p", { class: "muted" }, empty);
  return el("table", { id, class: "plain" }, el("thead", {}, el("tr", {}, ...head.map((h) => el("th", {}, h)))),
    el("tbody", {}, ...rows.map((r) => el("tr", {}, ...r.map((c) => el("td", {}, c))))));
}

function generations(rows) {
  if (rows.length === 0) {
    return el("p", { class: "muted" }, "None kept (trainer.log_val_generations = 0, or no validation ran).");
  }
  const steps = [...new Set(rows.map((g) => g.step))];
  const body = el("div");
  const fill = (step) => body.replaceChildren(table("generations", ["step", "source", "prompt", "response", "score"],
    rows.filter((g) => step === "all" || g.step === Number(step)).map((g) =>
      [String(g.step), g.data_source, el("pre", {}, g.prompt), el("pre", {}, g.response), fmtNum(g.score)]), ""));
  const pick = el("select", { id: "gen-step", onchange: (e) => fill(e.target.value) },
    el("option", { value: "all" }, `all ${steps.length} validations`),
    ...steps.map((s) => el("option", { value: String(s), selected: s === steps[steps.length - 1] }, `step ${s}`)));
  fill(String(steps[steps.length - 1]));
  return el("div", {}, el("label", {}, "validation at ", pick), body);
}

export async function runPage(idText) {
  const r = await api(`/api/run/${encodeURIComponent(idText)}`);
  document.title = `#${r.id} ${r.name} · harness ui`;
  const took = r.started ? (r.ended ?? r.heartbeat ?? r.started) - r.started : null;
  const facts = [
    ["project", r.project], ["status", statusPill(r.status)], ["seed", String(r.seed)],
    ["created", fmtTime(r.created)], ["started", fmtTime(r.started)], ["ended", fmtTime(r.ended)],
    ["duration", fmtDuration(took)], ["host / pid", `${r.host} / ${r.pid ?? "–"}`],
    ["git", r.git_commit ? `${r.git_commit.slice(0, 12)}${r.git_dirty ? " (dirty)" : ""}` : "–"],
    ["run folder", r.run_dir],
  ];
  if (r.sweep) facts.push(["sweep", el("a", { href: `#/sweep/${encodeURIComponent(r.sweep)}` }, `${r.sweep} (trial ${r.trial ?? "–"})`)]);
  if (r.resumed_from !== null) facts.push(["resumed", `from step ${r.resumed_from}`]);
  const resumeNote = r.status === "running" ? "It is running now; this continues it only after it stops."
    : r.checkpoints.length === 0 ? "It has no checkpoint yet, so there is nothing to resume from."
      : `Continues from its latest checkpoint (step ${r.checkpoints[r.checkpoints.length - 1].step}).`;
  const cmd = el("code", { id: "resume-command" }, r.resume_command);
  const copy = el("button", { class: "small", onclick: () => navigator.clipboard?.writeText(r.resume_command) }, "copy");
  show(
    el("p", { class: "crumbs" }, el("a", { href: "#/" }, "runs"), " / ", `#${r.id}`),
    el("h1", {}, `#${r.id} ${r.name} `, statusPill(r.status)),
    r.error ? el("div", { class: "error" }, r.error) : null,
    el("section", { class: "panel" }, el("dl", { class: "facts" }, ...facts.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]))),
    el("section", { class: "panel" }, el("h2", {}, "Resume"), el("div", { class: "cmd" }, cmd, copy), el("p", { class: "muted" }, resumeNote)),
    el("section", { class: "panel" }, el("h2", {}, "Final metrics"),
      table("metrics", ["metric", "value", "step"], r.metrics.map((m) => [m.key, m.value === null ? "NaN" : fmtNum(m.value), String(m.step)]), "No metric recorded yet.")),
    el("section", { class: "panel", id: "config" }, el("h2", {}, "Config"),
      el("p", { class: "muted" }, "Groups left at their defaults are folded."),
      ...r.config.map((g) => el("details", { open: !g.at_default, "data-group": g.name },
        el("summary", {}, g.name, g.at_default ? el("span", { class: "muted" }, " (defaults)") : null,
          el("span", { class: "muted" }, ` · ${g.entries.length} keys`)),
        el("table", { class: "plain kv" }, el("tbody", {}, ...g.entries.map(([k, v]) =>
          el("tr", {}, el("td", { class: "key" }, k), el("td", {}, fmtValue(v))))))))),
    el("section", { class: "panel" }, el("h2", {}, "Checkpoints"),
      table("checkpoints", ["step", "folder", "saved"], r.checkpoints.map((c) => [String(c.step), c.path, fmtTime(c.created)]), "No checkpoint recorded.")),
    el("section", { class: "panel" }, el("h2", {}, "Events"),
      table("events", ["time", "kind", "message"], r.events.map((e) => [fmtTime(e.time), e.kind, e.message]), "No events.")),
    el("section", { class: "panel" }, el("h2", {}, "Validation generations"), generations(r.generations)),
  );
}
