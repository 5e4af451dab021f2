// The run browser's entry: the routes (#/, #/run/ID, #/compare?runs=..., #/sweeps,
// #/sweep/ID), the state the runs view keeps across routes, and the live refresh.

import { RunsView } from "./runs.js";
import { runPage } from "./run.js";
import { compareView, sweepsView, sweepView } from "./compare.js";
import { show, errorBox } from "./util.js";
import { state, loadState } from "./state.js";

const REFRESH_MS = 3000;

window.harnessUi = { charts: new Map(), ready: false };


let current = null;

async function route() {
  window.harnessUi.ready = false;
  const hash = location.hash || "#/";
  const [path, query] = hash.slice(1).split("?");
  const params = new URLSearchParams(query || "");
  for (const a of document.querySelectorAll("nav a")) {
    const runs = path === "/" || path === "" || path.startsWith("/run/") || path === "/compare";
    a.classList.toggle("active", a.dataset.nav === "runs" ? runs : path.startsWith("/sweep"));
  }
  current = null;
  try {
    if (path === "/" || path === "") {
      loadState(params);
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
