// The run browser's entry: the routes (#/, #/run/ID, #/compare?runs=..., #/sweeps,
// #/sweep/ID), the state the runs view keeps across routes, and the live refresh.

import { RunsView } from "./runs.js";
import { runPage } from "./run.js";
import { compareView, sweepsView, sweepView } from "./compare.js";
import { show, errorBox } from "./util.js";

const REFRESH_MS = 3000;

window.harnessUi = { charts: new Map(), ready: false };

const state = {
  filter: "", sort: { col: "started", dir: -1 }, group: "none", selected: new Set(),
  metrics: [], smoothing: 0, xaxis: "step", log: false, band: true, runs: [], sweeps: {},
};

let current = null;

async function route() {
  window.harnessUi.ready = false;
  const hash = location.hash || "#/";
  const [path, query] = hash.slice(1).split("?");
  const params = new URLSearchParams(query || "");
  for (const a of document.querySelectorAll("nav a")) {
    a.classList.toggle("active", path.startsWith(`/${a.dataset.nav}`) || (a.dataset.nav === "runs" && (path === "/" || path.startsWith("/run") || path === "/compare")));
  }
  current = null;
  try {
    if (path === "/" || path === "") {
      current = new RunsView(state);
      await current.mount();
    } else if (path.startsWith("/run/")) {
      await runPage(decodeURIComponent(path.slice(5)));
    } else if (path === "/compare") {
      await compareView(params.get("runs") || "");
    } else if (path === "/sweeps") {
      await sweepsView();
    } else if (path.startsWith("/sweep/")) {
      await sweepView(decodeURIComponent(path.slice(7)), params.get("metric") || "");
    } else {
      show(errorBox(`No page ${hash}.`));
    }
  } catch (e) {
    show(errorBox(e.message));
  }
  window.harnessUi.ready = true;
}

async function tick() {
  if (document.visibilityState === "visible" && current && window.harnessUi.ready) {
    try {
      await current.refresh(true);
      document.getElementById("live").classList.remove("stale");
    } catch {
      document.getElementById("live").classList.add("stale");
    }
  }
  setTimeout(tick, REFRESH_MS);
}

window.addEventListener("hashchange", route);
route();
setTimeout(tick, REFRESH_MS);
