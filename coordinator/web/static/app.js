// dtfm web view: draws /api/view, then follows /api/events (server-sent events).
// Plain DOM, no framework and no build step. Every string from the cluster goes in as text
// (textContent), never as markup: agent ids and messages come from the network.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const state = { doc: null, metric: "bandwidth", tab: "cluster", pick: -1, relaySeen: {} };

function h(tag, attrs, ...kids) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") el.className = v; else if (k === "title") el.title = v;
    else el.setAttribute(k, v);
  }
  for (const kid of kids.flat()) {
    if (kid === null || kid === undefined) continue;
    el.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  }
  return el;
}

function s(tag, attrs, text) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = String(text);
  return el;
}

function put(id, ...kids) {
  const el = document.getElementById(id);
  el.replaceChildren(...kids.flat().filter((k) => k !== null && k !== undefined));
  return el;
}

const fmt = {
  n(v, d = 3) { return v === null || v === undefined || !isFinite(v) ? "–" : Number(v).toPrecision(d); },
  s(v) { return v ? (v < 1 ? `${(v * 1000).toFixed(0)} ms` : `${v.toFixed(2)} s`) : "–"; },
  rate(gbps) {
    if (gbps === null || gbps === undefined) return "–";
    return gbps >= 1 ? `${gbps.toFixed(1)} Gbit/s` : `${(gbps * 1000).toFixed(gbps < 0.01 ? 2 : 0)} Mbit/s`;
  },
  bytes(b) {
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (b >= 1024 && i < units.length - 1) { b /= 1024; i++; }
    return `${b.toFixed(i ? 1 : 0)} ${units[i]}`;
  },
  ago(sec) { return sec < 1 ? "now" : sec < 120 ? `${sec.toFixed(0)} s ago` : `${(sec / 60).toFixed(0)} min ago`; },
  clock(unix) { return new Date(unix * 1000).toLocaleTimeString([], { hour12: false }); },
};

function badge(text) { return h("span", { class: `badge ${text}` }, text); }

// ---- header and cards -------------------------------------------------------------------

function renderHead(st) {
  const j = st.job;
  const head = document.getElementById("job-head");
  if (!j.model) { head.replaceChildren(j.message || `no job (${j.state})`); return; }
  head.replaceChildren(h("b", {}, `job ${j.id}`), ` · ${j.model} · `, badge(j.state),
    j.message ? ` ${j.message}` : "");
  head.title = j.message || "";
}

// Jobs side by side on disjoint agents: a row each (the cards and charts below are the
// first one's). Hidden while one job runs alone.
function renderJobs(st) {
  const jobs = st.jobs || [], more = st.jobs_omitted || 0;
  document.getElementById("jobs-panel").classList.toggle("hidden", jobs.length + more < 2);
  document.getElementById("jobs-hint").textContent = jobs.length + more < 2 ? ""
    : `${jobs.length + more} side by side on disjoint agents; the cards below are ${jobs[0].id}'s`
      + (more ? ` (${more} more not listed: \`coordinator jobs\`)` : "");
  put("jobs", h("tr", {}, ["job", "state", "model", "step", "loss", "tokens/s", "agents"]
    .map((c) => h("th", {}, c))), jobs.map((j) => h("tr", { "data-job": j.id },
    h("td", { class: "mono" }, j.id), h("td", { title: j.message || "" }, badge(j.state)),
    h("td", {}, j.model), h("td", {}, `${j.step} / ${j.total_steps}`),
    h("td", {}, j.loss ? j.loss.toFixed(4) : "–"),
    h("td", {}, j.tokens_per_s ? Math.round(j.tokens_per_s).toLocaleString() : "–"),
    h("td", { class: "mono", title: j.share || "" },
      `${j.held_agents.length}: ${j.held_agents.slice(0, 8).join(", ")}`
      + (j.held_agents.length > 8 ? ` and ${j.held_agents.length - 8} more` : "")))));
}

function card(k, v, sub, frac) {
  return h("div", { class: "card" }, h("div", { class: "k" }, k), h("div", { class: "v" }, v),
    sub ? h("div", { class: "s" }, sub) : null,
    frac === undefined ? null : (() => {
      const bar = h("div", { class: "bar" }, h("div"));
      bar.firstChild.style.width = `${Math.max(0, Math.min(1, frac)) * 100}%`;
      return bar;
    })());
}

function renderCards(st) {
  const j = st.job;
  const alive = st.agents.filter((a) => a.state === "alive").length;
  const ratio = j.measured_step_s && j.predicted_step_s ? j.measured_step_s / j.predicted_step_s : 0;
  put("cards",
    h("div", { id: "card-step", class: "card" }, h("div", { class: "k" }, "step"),
      h("div", { class: "v", id: "step-value" }, `${j.step}`),
      h("div", { class: "s" }, `of ${j.total_steps} · epoch ${j.epoch}`),
      (() => { const bar = h("div", { class: "bar" }, h("div"));
        bar.firstChild.style.width = `${j.total_steps ? (100 * j.step) / j.total_steps : 0}%`;
        return bar; })()),
    card("loss", j.loss ? j.loss.toFixed(4) : "–", "training, last stage"
      + (j.val_step ? ` · validation ${j.val_loss.toFixed(4)} at step ${j.val_step}` : "")),
    card("tokens/s", j.tokens_per_s ? Math.round(j.tokens_per_s).toLocaleString() : "–", "global, measured"),
    card("step time", fmt.s(j.measured_step_s), `predicted ${fmt.s(j.predicted_step_s)}`
      + (ratio ? ` · ${ratio >= 1 ? "+" : ""}${((ratio - 1) * 100).toFixed(0)} %` : "")),
    card("agents", `${alive} / ${st.agents.length}`, `alive · job wants ${j.agents_wanted || "–"}`),
    card("checkpoint", j.checkpoint_step ? `step ${j.checkpoint_step}` : "–",
      `${j.recoveries.length} recoveries · ${j.replans.length} re-plans`));
}

// ---- charts -------------------------------------------------------------------------------

function lineChart(series, opts) {
  const W = 600, H = 220, L = 48, R = 12, T = 10, B = 26;
  const pts = series.flatMap((x) => x.points);
  if (!pts.length) return h("div", { class: "empty" }, opts.empty);
  let [x0, x1] = [Math.min(...pts.map((p) => p[0])), Math.max(...pts.map((p) => p[0]))];
  let [y0, y1] = [Math.min(...pts.map((p) => p[1])), Math.max(...pts.map((p) => p[1]))];
  if (opts.zero) y0 = 0;
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y1 += Math.abs(y1) * 0.1 || 1; y0 -= opts.zero ? 0 : Math.abs(y0) * 0.1; }
  const pad = (y1 - y0) * 0.06; y1 += pad; if (!opts.zero) y0 -= pad;
  const X = (v) => L + ((v - x0) / (x1 - x0)) * (W - L - R);
  const Y = (v) => T + (1 - (v - y0) / (y1 - y0)) * (H - T - B);
  const svg = s("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", role: "img" });
  for (let i = 0; i <= 4; i++) {
    const v = y0 + ((y1 - y0) * i) / 4;
    svg.append(s("line", { x1: L, x2: W - R, y1: Y(v), y2: Y(v), class: "axis" }),
      s("text", { x: L - 6, y: Y(v) + 4, "text-anchor": "end" }, opts.yfmt(v)));
  }
  const raw = (x1 - x0) / 5, mag = 10 ** Math.floor(Math.log10(raw));
  const step = Math.max(1, [1, 2, 5, 10].map((k) => k * mag).find((k) => k >= raw));
  for (let v = Math.ceil(x0 / step) * step; v <= x1; v += step) {
    svg.append(s("text", { x: X(v), y: H - 8, "text-anchor": "middle" }, v));
  }
  for (const ser of series) {
    if (!ser.points.length) continue;
    const d = ser.points.map((p, i) => `${i ? "L" : "M"}${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join("");
    svg.append(s("path", { d, fill: "none", stroke: ser.color, "stroke-width": ser.width || 2,
      "stroke-dasharray": ser.dash || "", "vector-effect": "non-scaling-stroke",
      "data-series": ser.name }));
    // sparse series (validation: one point per evaluation) get a dot at each point
    for (const p of ser.dots ? ser.points : []) {
      const dot = s("circle", { cx: X(p[0]).toFixed(1), cy: Y(p[1]).toFixed(1), r: 3,
        fill: ser.color, "data-series": ser.name });
      dot.append(s("title", {}, `step ${p[0]}: ${p[1].toFixed(4)}`));
      svg.append(dot);
    }
  }
  let lx = L + 8;
  for (const ser of series) {
    svg.append(s("rect", { x: lx, y: T + 2, width: 10, height: 3, fill: ser.color }),
      s("text", { x: lx + 14, y: T + 8 }, ser.name));
    lx += 24 + ser.name.length * 6.5;
  }
  return svg;
}

function renderCharts(doc) {
  const pts = doc.history.points.slice().sort((a, b) => a.epoch - b.epoch || a.step - b.step);
  const loss = pts.filter((p) => p.loss > 0).map((p) => [p.step, p.loss]);
  const val = pts.filter((p) => p.val_loss > 0).map((p) => [p.step, p.val_loss]);
  const lossSeries = [{ name: "training loss", color: "#5aa9e6", points: loss }];
  if (val.length) lossSeries.push({ name: "validation loss", color: "#f0883e", points: val, dots: true });
  put("loss-chart", lineChart(lossSeries, { empty: "no loss reported yet", yfmt: (v) => v.toFixed(2) }));
  document.getElementById("loss-hint").textContent = loss.length || val.length
    ? `${loss.length} steps recorded${doc.history.points.length >= 400 ? " (thinned)" : ""}`
      + (val.length ? ` · ${val.length} validations` : "") : "";
  const step = pts.filter((p) => p.step_s > 0).map((p) => [p.step, p.step_s]);
  const predicted = doc.status.job.predicted_step_s || doc.history.predicted_step_s;
  const series = [{ name: "measured", color: "#3fb950", points: step }];
  if (predicted && step.length) {
    series.push({ name: "predicted", color: "#b392f0", dash: "6 4",
      points: [[step[0][0], predicted], [step[step.length - 1][0], predicted]] });
  }
  put("step-chart", lineChart(series, { empty: "no step measured yet", zero: true,
    yfmt: (v) => (v < 1 ? `${(v * 1000).toFixed(0)}ms` : `${v.toFixed(1)}s`) }));
}

// ---- grid ---------------------------------------------------------------------------------

function gridOf(plan, agents, compare) {
  if (!plan) return h("div", { class: "empty" }, "no plan yet");
  const byId = Object.fromEntries(agents.map((a) => [a.id, a]));
  const el = h("div", { class: "grid" });
  el.style.gridTemplateColumns = `auto repeat(${plan.replicas}, minmax(0, 1fr))`;
  el.append(h("div"));
  for (let r = 0; r < plan.replicas; r++) el.append(h("div", { class: "head" }, `replica ${r}`));
  plan.grid.forEach((row, st) => {
    const layers = plan.layer_splits.length ? plan.layer_splits[st] : null;
    let first = 0;
    for (let i = 0; i < st; i++) first += plan.layer_splits[i] || 0;
    el.append(h("div", { class: "stage" }, `stage ${st}`,
      layers ? h("div", { class: "sub" }, `layers ${first}–${first + layers - 1}`) : null));
    row.forEach((id, r) => {
      const a = byId[id];
      const moved = compare && compare.grid[st] && compare.grid[st][r] !== id;
      const w = a && a.worker;
      const sub = w && w.state === "training" ? `step ${w.step} · ${fmt.s(w.step_s)}` : (w ? w.state : "not listed");
      const share = plan.dp_shares[st] && plan.dp_shares[st].length > 1
        && Math.max(...plan.dp_shares[st]) - Math.min(...plan.dp_shares[st]) > 1e-9
        ? ` · ${(plan.dp_shares[st][r] * 100).toFixed(0)} % grads` : "";
      el.append(h("div", { class: `cell ${a ? a.state : "lost"}${moved ? " moved" : ""}`,
        "data-agent": id, title: `${id}${a ? ` (${a.state}, ${a.address})` : ""}` },
      h("div", { class: "id" }, id), h("div", { class: "sub" }, `${layers ? `${layers} layers · ` : ""}${sub}${share}`)));
    });
  });
  return el;
}

function planFacts(plan) {
  if (!plan) return null;
  return h("div", { class: "kv" }, `epoch `, h("b", {}, plan.epoch), ` · ${plan.stages}×${plan.replicas} · `,
    `${plan.placement || "scheduled"}${plan.algorithm ? ` (${plan.algorithm})` : ""} · predicted step `,
    h("b", {}, fmt.s(plan.predicted_step_s)), ` (compute ${fmt.s(plan.predicted_compute_s)}, comm `,
    `${fmt.s(plan.predicted_comm_s)}) · cost ${fmt.n(plan.cost)} s`,
    plan.sync_every > 1 ? ` · sync every ${plan.sync_every}` : "",
    plan.sync_every > 1 && plan.outer_delay ? ` (outer step one round late)` : "");
}

function renderGrid(st) {
  document.getElementById("grid-hint").textContent = st.plan
    ? `${st.plan.stages} stages × ${st.plan.replicas} replicas · epoch ${st.plan.epoch}` : "";
  put("grid", gridOf(st.plan, st.agents, null), planFacts(st.plan));
}

// ---- links --------------------------------------------------------------------------------

function heat(t) { // 0 (bad) .. 1 (good): red -> amber -> green
  const c = [[248, 81, 73], [210, 153, 34], [63, 185, 80]];
  const i = t < 0.5 ? 0 : 1, f = t < 0.5 ? t * 2 : (t - 0.5) * 2;
  return `rgb(${c[i].map((v, k) => Math.round(v + (c[i + 1][k] - v) * f)).join(",")})`;
}

function renderLinks(st, doc) {
  const m = st.links;
  if (!m || !m.agents.length) { put("links", h("div", { class: "empty" }, "links not measured yet")); put("relay"); return; }
  const n = m.agents.length, bw = state.metric === "bandwidth";
  const vals = (bw ? m.bandwidth_gbps : m.delay_ms).flat().filter((v) => v !== null && v > 0);
  const lo = Math.min(...vals), hi = Math.max(...vals);
  const norm = (v) => { // log scale, 1 = best
    if (hi <= lo) return 1;
    const t = (Math.log(v) - Math.log(lo)) / (Math.log(hi) - Math.log(lo));
    return bw ? t : 1 - t;
  };
  const relayed = new Set(m.relayed), punched = new Set(m.punched), down = new Set(m.unreachable);
  const label = Math.min(110, 8 + Math.max(...m.agents.map((a) => a.length)) * 7);
  const cell = Math.max(14, Math.min(64, Math.floor(560 / n)));
  const size = label + n * cell + 2, width = size + label / 2;
  const svg = s("svg", { width, height: size, viewBox: `0 0 ${width} ${size}` });
  m.agents.forEach((id, i) => {
    const short = id.length > 14 ? `…${id.slice(-13)}` : id;
    svg.append(s("text", { x: label - 6, y: label + i * cell + cell / 2 + 4, "text-anchor": "end" }, short));
    svg.append(s("text", { x: 0, y: 0, transform: `translate(${label + i * cell + cell / 2 + 3},${label - 6}) rotate(-45)` }, short));
  });
  m.agents.forEach((src, i) => m.agents.forEach((dst, j) => {
    if (i === j) return;
    const pair = `${src}->${dst}`, v = (bw ? m.bandwidth_gbps : m.delay_ms)[i][j];
    const x = label + j * cell, y = label + i * cell;
    const fill = down.has(pair) ? "#3a1e22" : v === null ? "#232c36" : heat(norm(v));
    const rect = s("rect", { x: x + 1, y: y + 1, width: cell - 2, height: cell - 2, rx: 3, fill });
    const tip = `${src} → ${dst}: ${fmt.rate(m.bandwidth_gbps[i][j])}, ${fmt.n(m.delay_ms[i][j])} ms`
      + (relayed.has(pair) ? " · relayed" : "") + (punched.has(pair) ? " · hole-punched" : "")
      + (down.has(pair) ? " · unreachable" : "") + (m.estimated[pair] ? ` · estimated: ${m.estimated[pair]}` : "");
    rect.append(s("title", {}, tip));
    svg.append(rect);
    const mark = down.has(pair) ? "×" : relayed.has(pair) ? "R" : punched.has(pair) ? "P" : m.estimated[pair] ? "~" : "";
    if (mark && cell >= 14) svg.append(s("text", { x: x + cell / 2, y: y + cell / 2 + 4, "text-anchor": "middle", class: "mark" }, mark));
  }));
  put("links", svg, h("div", { class: "legend" },
    `${bw ? "bandwidth" : "one-way delay"}: row = from, column = to; green = ${bw ? fmt.rate(hi) : `${fmt.n(lo)} ms`}, `
    + `red = ${bw ? fmt.rate(lo) : `${fmt.n(hi)} ms`} (log scale) · R relayed · P hole-punched · × unreachable · ~ estimated`));
  document.getElementById("links-hint").textContent = `${n} agents`;
  renderRelays(st, m, doc.relays || []);
}

function rateOf(key, now, bytes) { // bytes/s since the previous document, per relay
  const seen = state.relaySeen[key];
  if (seen && now === seen[0]) return seen[2]; // the same document drawn again
  const rate = seen && now > seen[0]
    ? ` · now ${fmt.bytes(Math.max(0, (bytes - seen[1]) / (now - seen[0])))}/s` : "";
  state.relaySeen[key] = [now, bytes, rate];
  return rate;
}

function renderRelays(st, m, agents) {
  const relay = st.job.relay, now = st.time;
  const lines = [h("div", {}, `relays: ${m.relayed.length} relayed pair(s), ${m.punched.length} hole-punched · `
    + `all relays forwarded ${fmt.bytes(relay.forwarded_bytes)}${rateOf("all", now, relay.forwarded_bytes)}, `
    + `refused ${fmt.bytes(relay.refused_bytes)}`)];
  for (const r of agents) {
    lines.push(h("div", {}, `relay agent ${r.agent} (port ${r.port}): forwarded ${fmt.bytes(r.forwarded_bytes)}`
      + `${rateOf(r.agent, now, r.forwarded_bytes)}, refused ${fmt.bytes(r.refused_bytes)}`));
  }
  put("relay", lines);
}

// ---- agents and events ----------------------------------------------------------------------

function renderAgents(st) {
  const rows = [h("tr", {}, ["agent", "state", "reach", "device", "site", "worker", "step", "loss", "step split", "seen"]
    .map((c) => h("th", {}, c)))];
  for (const a of st.agents) {
    const w = a.worker, d = a.device;
    const speed = !d.flops ? "?" : d.flops >= 1e12 ? `${(d.flops / 1e12).toPrecision(3)} TFLOP/s`
      : `${(d.flops / 1e9).toPrecision(3)} GFLOP/s`;
    const dev = `${d.kind} · ${speed}`
      + (d.memory_bytes ? ` · ${(d.memory_bytes / 2 ** 30).toFixed(0)} GiB` : "");
    const split = w.step_s ? `${w.compute_s.toFixed(2)}+${w.pp_wait_s.toFixed(2)}+${w.dp_s.toFixed(2)} s` : "–";
    rows.push(h("tr", { "data-agent": a.id, "data-state": a.state },
      h("td", { class: "mono" }, a.id), h("td", {}, badge(a.state)),
      h("td", { title: a.reach.summary || "" }, badge(a.reach.verdict)), h("td", { title: d.name || "" }, dev),
      h("td", { class: "mono" }, a.address.replace(/:\d+$/, "")),
      h("td", { title: w.error || "" }, w.state + (w.error ? ` (${w.error_kind || "error"})` : "")),
      h("td", {}, w.step || "–"), h("td", {}, w.loss ? w.loss.toFixed(3) : "–"),
      h("td", { title: "compute + pipeline wait + data-parallel sync" }, split),
      h("td", {}, fmt.ago(a.last_seen_ago_s))));
  }
  put("agents", rows);
  const alive = st.agents.filter((a) => a.state === "alive").length;
  document.getElementById("agents-hint").textContent = `${alive} alive of ${st.agents.length}`
    + (st.agents_omitted ? ` (${st.agents_omitted} more not listed)` : "");
}

function renderEvents(events) {
  put("events", events.slice().reverse().map((e) => h("li", { class: e.kind },
    h("span", { class: "t" }, fmt.clock(e.at)), h("span", { class: "kind" }, e.kind),
    h("span", { class: "text", title: e.text }, e.text.length > 180 ? `${e.text.slice(0, 180)}…` : e.text))));
}

// ---- planner ------------------------------------------------------------------------------

function renderPlanner(doc) {
  const st = doc.status, plans = doc.plans;
  const pick = document.getElementById("plan-pick");
  const want = state.pick >= 0 && state.pick < plans.length ? state.pick : plans.length - 1;
  pick.replaceChildren(...plans.map((p, i) => h("option", { value: i },
    `epoch ${p.epoch}: ${p.stages}×${p.replicas}, until ${fmt.clock(p.until)}`)));
  if (want >= 0) pick.value = String(want);
  const then = want >= 0 ? plans[want] : null;
  put("plan-now", gridOf(st.plan, st.agents, then), planFacts(st.plan));
  put("plan-then", then ? [gridOf(then, st.agents, st.plan), planFacts(then)]
    : h("div", { class: "empty" }, "no earlier plan: the job has run one plan since this view started watching"));
  const replans = st.job.replans;
  put("replans", replans.length ? [h("tr", {}, ["when", "step", "trigger", "stay", "new", "gain", "cost", "decision", "outcome", "after"]
    .map((c) => h("th", {}, c))), ...replans.slice().reverse().map((r) => h("tr", {},
    h("td", {}, fmt.clock(r.at_unix_s)), h("td", {}, r.at_step), h("td", { title: r.trigger }, r.trigger.slice(0, 60)),
    h("td", {}, fmt.s(r.predicted_stay_s)), h("td", {}, fmt.s(r.predicted_new_s)), h("td", {}, `${r.gain_s.toFixed(1)} s`),
    h("td", {}, `${r.cost_s.toFixed(1)} s`), h("td", { title: r.why }, r.decision), h("td", {}, r.outcome),
    h("td", {}, fmt.s(r.step_after_s))))] : h("tr", {}, h("td", { class: "empty" }, "no re-plan weighed yet")));
}

// ---- plumbing -----------------------------------------------------------------------------

function render(doc) {
  state.doc = doc;
  const st = doc.status;
  renderHead(st);
  renderJobs(st);
  renderCards(st);
  renderCharts(doc);
  renderGrid(st);
  renderLinks(st, doc);
  renderAgents(st);
  renderEvents(doc.events);
  renderPlanner(doc);
  document.body.dataset.step = String(st.job.step);
}

function live(on) {
  const el = document.getElementById("live");
  el.className = `live ${on ? "on" : "off"}`;
  el.title = on ? "live" : "reconnecting…";
}

function denied() {
  const b = document.getElementById("banner");
  b.textContent = "Not logged in (or the session expired): open the URL that `coordinator web-url` prints.";
  b.classList.remove("hidden");
}

async function load() {
  const r = await fetch("/api/view", { cache: "no-store" });
  if (r.status === 401) { denied(); return false; }
  if (!r.ok) throw new Error(`/api/view: HTTP ${r.status}`);
  render(await r.json());
  return true;
}

function follow() {
  const es = new EventSource("/api/events");
  es.onopen = () => live(true);
  es.onmessage = (ev) => { live(true); render(JSON.parse(ev.data)); };
  es.onerror = async () => {
    live(false);
    if (es.readyState === EventSource.CLOSED) {
      es.close();
      const r = await fetch("/api/view", { cache: "no-store" }).catch(() => null);
      if (r && r.status === 401) { denied(); return; }
      setTimeout(follow, 2000);
    }
  };
}

function tabs() {
  for (const b of document.querySelectorAll(".tab")) {
    b.addEventListener("click", () => {
      state.tab = b.dataset.tab;
      for (const x of document.querySelectorAll(".tab")) x.classList.toggle("active", x === b);
      document.getElementById("tab-cluster").classList.toggle("hidden", state.tab !== "cluster");
      document.getElementById("tab-planner").classList.toggle("hidden", state.tab !== "planner");
    });
  }
  for (const b of document.querySelectorAll(".metric")) {
    b.addEventListener("click", () => {
      state.metric = b.dataset.metric;
      for (const x of document.querySelectorAll(".metric")) x.classList.toggle("active", x === b);
      if (state.doc) renderLinks(state.doc.status, state.doc);
    });
  }
  document.getElementById("plan-pick").addEventListener("change", (ev) => {
    state.pick = Number(ev.target.value);
    if (state.doc) renderPlanner(state.doc);
  });
}

document.addEventListener("DOMContentLoaded", async () => {
  tabs();
  if (await load()) follow();
});
