// The live dashboard of `deepinfer serve`. Each second it reads this server's own GET metrics
// (Prometheus text, parsed here: every figure shown is one /metrics reports, or a rate of two of
// its readings) and GET dashboard/state (one request's block tables and rings, with the API key
// the chat page also uses). Relative URLs, so the page also works behind a path prefix. Names
// from the server are shown as text (textContent), never parsed as HTML.
//
// For tests and scripts: <body data-refreshes> counts finished refreshes, and data-metrics holds
// the raw /metrics values (and the rates) that refresh showed.
"use strict";

const REFRESH_MS = 1000;
const HISTORY_S = 120;
const COLORS = ["#2f5fb3", "#e8a33d", "#3a9a5b", "#b3412f", "#7a4fb3", "#3aa1a1"];

const $ = (id) => document.getElementById(id);

const dash = {
  history: [], // {t (s), running, waiting, genRate, promptRate, hitRate, blocks: {group: used}, rings: {group: used}}
  previous: null, // the last reading: {t, gen, prompt}, for the rates
  refreshes: 0,
  sourceKey: "replica", // the label whose value `replica` holds: "replica" or "model"
};

function showError(text) {
  $("error").textContent = text;
  $("error").hidden = !text;
}

// -- Prometheus text ------------------------------------------------------------------------------

/** The samples of a Prometheus text body: [{name, labels: {k: v}, value}] (comments skipped). */
function parsePrometheus(text) {
  const samples = [];
  const line = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/;
  const label = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g;
  for (const row of text.split("\n")) {
    const m = line.exec(row);
    if (!m || row.startsWith("#")) continue;
    const labels = {};
    for (const l of (m[2] || "").matchAll(label)) labels[l[1]] = l[2].replace(/\\(.)/g, (_, c) => (c === "n" ? "\n" : c));
    samples.push({ name: m[1], labels, value: Number(m[3]) });
  }
  return samples;
}

/** Behind a data-parallel front end every replica's samples carry `replica`, behind a model host every
 * loaded model's carry `model`: keep one's (`?replica=R` or `?model=NAME` in the page's address, else the
 * first seen), without that label; the picker offers the others. */
function oneReplica(samples) {
  const key = samples.some((s) => "model" in s.labels) ? "model" : "replica";
  const byRank = (a, b) => (key === "replica" ? Number(a) - Number(b) : a.localeCompare(b));
  const values = [...new Set(samples.filter((s) => key in s.labels).map((s) => s.labels[key]))].sort(byRank);
  if (!values.length) return samples;
  const wanted = new URLSearchParams(location.search).get(key);
  dash.sourceKey = key;
  dash.replica = values.includes(wanted) ? wanted : values[0];
  showSources(values);
  return samples.filter((s) => s.labels[key] === dash.replica).map((s) => {
    const { [key]: _, ...labels } = s.labels;
    return { ...s, labels };
  });
}

/** The picker of models (or replicas): choosing one reloads the page with it in the address. */
function showSources(values) {
  const picker = $("source");
  if (picker.dataset.values !== values.join("\n")) {
    picker.dataset.values = values.join("\n");
    picker.replaceChildren(...values.map((value) => {
      const option = document.createElement("option");
      option.value = option.textContent = value;
      return option;
    }));
  }
  picker.value = dash.replica;
  picker.hidden = false;
}

/** The one unlabelled sample named `name` (null if absent). */
function scalar(samples, name) {
  const s = samples.find((x) => x.name === name && Object.keys(x.labels).length === 0);
  return s ? s.value : null;
}

/** {label value: sample value} of the samples named `name`, by their `label`. */
function byLabel(samples, name, label) {
  const out = {};
  for (const s of samples) if (s.name === name && label in s.labels) out[s.labels[label]] = s.value;
  return out;
}

/** What one refresh shows, from one /metrics body (`now` in seconds, for the rates). */
function reading(samples, now) {
  const r = {
    t: now,
    running: scalar(samples, "deepinfer_num_requests_running"),
    waiting: scalar(samples, "deepinfer_num_requests_waiting"),
    gen: scalar(samples, "deepinfer_generation_tokens_total"),
    prompt: scalar(samples, "deepinfer_prompt_tokens_total"),
    hits: scalar(samples, "deepinfer_prefix_cache_hits_total"),
    queries: scalar(samples, "deepinfer_prefix_cache_queries_total"),
    kvUsage: scalar(samples, "deepinfer_kv_cache_usage_perc"),
    blocksUsed: byLabel(samples, "deepinfer_kv_group_blocks_used", "group"),
    blocksTotal: byLabel(samples, "deepinfer_kv_group_blocks_total", "group"),
    slotsUsed: byLabel(samples, "deepinfer_kv_ring_slots_used", "group"),
    slotsTotal: byLabel(samples, "deepinfer_kv_ring_slots_total", "group"),
  };
  r.hitRate = r.queries ? r.hits / r.queries : null;
  const p = dash.previous;
  const dt = p ? now - p.t : 0;
  r.genRate = dt > 0 ? Math.max(0, r.gen - p.gen) / dt : null;
  r.promptRate = dt > 0 ? Math.max(0, r.prompt - p.prompt) / dt : null;
  return r;
}

// -- tiles ----------------------------------------------------------------------------------------

const fmtCount = (v) => (v === null || v === undefined ? "–" : String(v));
const fmtRate = (v) => (v === null ? "–" : v.toFixed(1));
const fmtPercent = (v, digits = 1) => (v === null ? "–" : `${(100 * v).toFixed(digits)}%`);

function showTiles(r) {
  $("v-running").textContent = fmtCount(r.running);
  $("v-waiting").textContent = fmtCount(r.waiting);
  $("v-gen-rate").textContent = fmtRate(r.genRate);
  $("v-prompt-rate").textContent = fmtRate(r.promptRate);
  $("v-gen-total").textContent = fmtCount(r.gen);
  $("v-prompt-total").textContent = fmtCount(r.prompt);
  $("v-hit-rate").textContent = fmtPercent(r.hitRate);
  $("v-kv-usage").textContent = fmtPercent(r.kvUsage, 2);
  const box = $("group-tiles");
  box.replaceChildren(
    ...Object.keys(r.blocksTotal).map((g) => groupTile("paged", g, `blocks of ${g}`, r.blocksUsed[g], r.blocksTotal[g])),
    ...Object.keys(r.slotsTotal).map((g) => groupTile("ring", g, `ring slots of ${g}`, r.slotsUsed[g], r.slotsTotal[g])),
  );
}

function groupTile(kind, group, label, used, total) {
  const tile = document.createElement("div");
  tile.className = "tile group";
  tile.dataset.kind = kind;
  tile.dataset.group = group;
  const name = document.createElement("span");
  name.className = "label";
  name.textContent = label;
  const value = document.createElement("span");
  value.className = "value";
  value.textContent = `${fmtCount(used)} / ${fmtCount(total)}`;
  tile.append(name, value);
  return tile;
}

// -- charts ---------------------------------------------------------------------------------------

/** Line chart of `series` ([{name, values: [[t, v]...]}]) over the last HISTORY_S seconds. */
function drawChart(canvas, series, now, fixedMax) {
  const ratio = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  canvas.width = Math.round(w * ratio);
  canvas.height = Math.round(h * ratio);
  const ctx = canvas.getContext("2d");
  ctx.scale(ratio, ratio);
  ctx.clearRect(0, 0, w, h);
  const values = series.flatMap((s) => s.values.map(([, v]) => v)).filter((v) => v !== null);
  const yMax = fixedMax || Math.max(1, ...values) * 1.1;
  const pad = { l: 34, r: 6, t: 16, b: 14 };
  const x = (t) => pad.l + (w - pad.l - pad.r) * (1 - (now - t) / HISTORY_S);
  const y = (v) => h - pad.b - (h - pad.t - pad.b) * (v / yMax);
  ctx.strokeStyle = "#d8dbe0";
  ctx.fillStyle = "#555";
  ctx.font = "10px system-ui, sans-serif";
  ctx.strokeRect(pad.l, pad.t, w - pad.l - pad.r, h - pad.t - pad.b);
  ctx.fillText(yMax >= 10 ? yMax.toFixed(0) : yMax.toFixed(2), 2, pad.t + 8);
  ctx.fillText("0", 2, h - pad.b);
  ctx.fillText(`−${HISTORY_S} s`, pad.l, h - 2);
  if (!series.length) ctx.fillText("none in this model", pad.l + 8, pad.t + 14);
  series.forEach((s, i) => drawLine(ctx, s, COLORS[i % COLORS.length], x, y, pad.l + 4 + 90 * i));
}

function drawLine(ctx, s, color, x, y, legendX) {
  ctx.strokeStyle = color;
  ctx.fillStyle = color;
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  let pen = false;
  for (const [t, v] of s.values) {
    if (v === null || v === undefined) { pen = false; continue; }
    if (pen) ctx.lineTo(x(t), y(v));
    else ctx.moveTo(x(t), y(v));
    pen = true;
  }
  ctx.stroke();
  ctx.fillText(s.name, legendX, 11);
}

function drawCharts(now) {
  const h = dash.history;
  const line = (name, pick) => ({ name, values: h.map((p) => [p.t, pick(p)]) });
  const groups = (key) => [...new Set(h.flatMap((p) => Object.keys(p[key])))];
  drawChart($("chart-requests"), [line("running", (p) => p.running), line("waiting", (p) => p.waiting)], now);
  drawChart($("chart-tokens"), [line("generated", (p) => p.genRate), line("prompt", (p) => p.promptRate)], now);
  // blocks: scaled to the blocks used (a pool of 100k blocks would flatten every line); the tiles show the totals
  drawChart($("chart-blocks"), groups("blocksUsed").map((g) => line(g, (p) => p.blocksUsed[g] ?? null)), now);
  drawChart($("chart-rings"), groups("slotsUsed").map((g) => line(g, (p) => p.slotsUsed[g] ?? null)), now,
    Math.max(1, ...h.flatMap((p) => Object.values(p.slotsTotal))));
  drawChart($("chart-hit"), [line("hit rate", (p) => p.hitRate)], now, 1);
}

// -- one request's block tables and rings -----------------------------------------------------------

/** The running requests, oldest first, as the options (rebuilt only when they change: an open list stays open). */
function showRequestList(running) {
  const select = $("request");
  const ids = running.map((r) => r.request_id);
  if (select.dataset.ids === JSON.stringify(ids)) return;
  const chosen = select.value;
  select.replaceChildren(new Option("oldest running", ""), ...ids.map((id) => new Option(id, id)));
  select.value = ids.includes(chosen) ? chosen : "";
  select.dataset.ids = JSON.stringify(ids);
}

function showRequest(req) {
  const info = $("request-info");
  info.dataset.requestId = req ? req.request_id : "";
  if (!req) {
    info.textContent = "no request is running";
    $("block-table").replaceChildren();
    $("rings").replaceChildren();
    return;
  }
  info.textContent = `${req.request_id}: ${req.num_computed_tokens} of ${req.num_tokens} tokens computed ` +
    `(prompt ${req.num_prompt_tokens}, ${req.num_cached_tokens} found cached)`;
  $("block-table").replaceChildren(...req.paged.map(blockTable));
  $("rings").replaceChildren(...req.rings.map(ringPicture));
}

function blockTable(g) {
  const cells = g.block_ids.map((id, j) => {
    const cell = document.createElement("span");
    cell.className = `block${j < g.num_hit_blocks ? " hit" : g.cached[j] ? " cached" : ""}`;
    cell.dataset.blockId = id;
    cell.textContent = id;
    cell.title = `block ${j}: tokens ${j * g.tokens_per_block}..${(j + 1) * g.tokens_per_block - 1}`;
    return cell;
  });
  const per = g.compress_ratio > 1 ? `${g.block_size} rows × ${g.compress_ratio} tokens` : `${g.block_size} tokens`;
  return picture("paged", g.group, `${g.group}: block table, ${g.block_ids.length} blocks of ${per}`, cells, false);
}

function ringPicture(g) {
  const last = g.num_written - 1;
  const cells = g.rows.map((p, r) => {
    const cell = document.createElement("span");
    const state = p < 0 ? "empty" : p === last ? "latest" : p >= g.window_start ? "window" : "old";
    cell.className = `ring-row ${state}`;
    cell.textContent = p < 0 ? "·" : p;
    cell.title = `row ${r} · slot ${g.first_slot + r} · ${p < 0 ? "empty" : `position ${p}`}`;
    return cell;
  });
  const label = `${g.group}: state ${g.state_id}, S = ${g.ring_size} rows (slots ${g.first_slot}..` +
    `${g.first_slot + g.ring_size - 1}), W = ${g.window}; position p at row p mod S; window ` +
    `${g.window_start}..${Math.max(last, 0)}`;
  return picture("ring", g.group, label, cells, g.ring_size > 256);
}

function picture(kind, group, label, cells, small) {
  const box = document.createElement("div");
  box.className = `picture ${kind}`;
  box.dataset.group = group;
  const name = document.createElement("div");
  name.className = "group-name";
  name.textContent = label;
  const row = document.createElement("div");
  row.className = small ? "cells small" : "cells";
  row.append(...cells);
  box.append(name, row);
  return box;
}

// -- the refresh loop ------------------------------------------------------------------------------

async function fetchState() {
  const id = $("request").value;
  const query = new URLSearchParams();
  if (id) query.set("request_id", id);
  if (dash.replica !== undefined) query.set(dash.sourceKey, dash.replica); // the front end sends it there
  const url = "dashboard/state" + (query.size ? `?${query}` : "");
  const response = await fetch(url, { headers: authHeaders(), cache: "no-store" });
  if (response.status === 401) {
    $("settings").open = true;
    throw new Error("the server refused the API key (401): enter the key it was started with (--api-key) " +
      "under Settings to see the request picture");
  }
  if (!response.ok) throw new Error(`dashboard/state answered ${response.status}`);
  return response.json();
}

async function refresh() {
  const metrics = fetch("metrics", { cache: "no-store" }).then((r) => {
    if (!r.ok) throw new Error(`metrics answered ${r.status}`);
    return r.text();
  });
  const state = fetchState();
  const [m, s] = await Promise.allSettled([metrics, state]);
  const now = performance.now() / 1000;
  if (m.status === "fulfilled") showMetrics(reading(oneReplica(parsePrometheus(m.value)), now), now);
  if (s.status === "fulfilled") {
    showRequestList(s.value.running);
    showRequest(s.value.request);
  }
  const failed = [m, s].filter((x) => x.status === "rejected").map((x) => x.reason.message);
  showError(failed.join("; "));
  $("status").textContent = `updated ${new Date().toLocaleTimeString()}`;
  dash.refreshes += 1;
  document.body.dataset.refreshes = String(dash.refreshes);
}

function showMetrics(r, now) {
  dash.previous = r;
  dash.history.push({ t: now, running: r.running, waiting: r.waiting, genRate: r.genRate, promptRate: r.promptRate,
    hitRate: r.hitRate, blocksUsed: r.blocksUsed, blocksTotal: r.blocksTotal, slotsUsed: r.slotsUsed,
    slotsTotal: r.slotsTotal });
  while (dash.history.length && dash.history[0].t < now - HISTORY_S) dash.history.shift();
  showTiles(r);
  drawCharts(now);
  document.body.dataset.metrics = JSON.stringify(r);
}

async function loop() {
  try {
    await refresh();
  } catch (err) {
    showError(`The refresh failed: ${err.message}`);
  }
  setTimeout(loop, REFRESH_MS);
}

loadStoredKey();
$("api-key").addEventListener("change", storeKey);
$("request").addEventListener("change", refresh);
loop();
$("source").addEventListener("change", () => {
  const query = new URLSearchParams(location.search);
  query.set(dash.sourceKey, $("source").value);
  location.search = query.toString();
});
