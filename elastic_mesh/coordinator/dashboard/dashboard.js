// The run's live dashboard. Polls /status (nodes, epoch) and /v1/history (telemetry since the last
// poll, every round's attempts) and redraws; no reload, no network beyond the coordinator.
"use strict";

const POLL_MS = 2000;
const MAX_POINTS_PER_LINE = 1500;
const token = new URLSearchParams(location.hash.slice(1)).get("token");
const headers = token ? { Authorization: "Bearer " + token } : {};
const perNode = new Map();  // name -> {loss: [[tokens, loss]], evals: [[tokens, eval]]}
let lastId = 0;
let rounds = [];
let events = [];

function nodeSeries(name) {
  if (!perNode.has(name)) perNode.set(name, { loss: [], evals: [] });
  return perNode.get(name);
}

function thin(points) {
  if (points.length <= MAX_POINTS_PER_LINE) return points;
  const every = Math.ceil(points.length / MAX_POINTS_PER_LINE);
  return points.filter((_, i) => i % every === 0 || i === points.length - 1);
}

async function getJSON(path) {
  const response = await fetch(path, { headers, cache: "no-store" });
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}

function absorb(history) {
  for (const r of history.records) {
    const s = nodeSeries(r.node);
    if (r.loss !== undefined && r.tokens !== undefined) s.loss.push([r.tokens, r.loss]);
    if (r.outer_eval_loss !== undefined && r.tokens !== undefined) s.evals.push([r.tokens, r.outer_eval_loss]);
  }
  lastId = history.last_id;
  rounds = history.rounds;
  events = history.events;
}

function cell(text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

function ago(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  if (seconds < 90) return seconds.toFixed(0) + " s ago";
  if (seconds < 5400) return (seconds / 60).toFixed(0) + " min ago";
  return (seconds / 3600).toFixed(1) + " h ago";
}

function fmt(v, digits) {
  return v === undefined || v === null ? "–" : (digits === undefined ? PrimeCharts.formatNumber(v) : v.toFixed(digits));
}

function renderNodes(status) {
  const body = document.querySelector("#nodes tbody");
  body.replaceChildren(...status.nodes.map(n => {
    const tr = document.createElement("tr");
    tr.dataset.node = n.name;
    const state = n.state === "active" && !n.alive ? "active (lease lapsed)" : n.state;
    tr.append(cell(n.name), cell(state, "state-" + n.state), cell(n.address || "–"),
              cell(new Date(n.joined_at * 1000).toLocaleTimeString()),
              cell(String(n.contributions), "num"), cell(fmt(n.tokens_contributed), "num"),
              cell(fmt(n.step), "num"), cell(fmt(n.loss, 3), "num"), cell(fmt(n.tokens_per_s), "num"),
              cell(fmt(n.link_mbit_s), "num"),
              cell(ago(n.last_heartbeat_s), n.last_heartbeat_s > 10 ? "stale" : ""));
    return tr;
  }));
  const alive = status.nodes.filter(n => n.state === "active" && n.alive).length;
  document.getElementById("run-id").textContent = status.run_id;
  document.getElementById("summary").innerHTML =
    `<span>round <b>${status.committed_round}</b></span><span>epoch <b>${status.epoch}</b></span>` +
    `<span><b>${alive}</b> of ${status.nodes.length} nodes alive</span>` +
    `<span>barrier wait <b>${status.deadline_s}</b> s</span>`;
}

function renderCharts() {
  const names = [...perNode.keys()].sort();
  const series = [];
  names.forEach((name, i) => {
    const color = PrimeCharts.PALETTE[i % PrimeCharts.PALETTE.length];
    series.push({ name, color, points: thin(perNode.get(name).loss) });
    series.push({ color, dots: true, points: perNode.get(name).evals });
  });
  PrimeCharts.lines(document.getElementById("loss-chart"), series, { xLabel: "tokens (per node)" });

  const applied = rounds.filter(s => s.decision === "apply");
  PrimeCharts.bars(document.getElementById("allreduce-chart"),
    rounds.filter(s => s.allreduce_s !== null && s.decision !== "open").map(s => ({
      x: s.round, y: s.allreduce_s, color: s.decision === "apply" ? "#0969da" : "#cf222e" })),
    { xLabel: "round", legend: [["applied", "#0969da"], ["aborted attempt", "#cf222e"]] });

  const members = [...new Set(rounds.flatMap(s => s.members))];
  PrimeCharts.lanes(document.getElementById("membership-chart"), members.map(name => ({
    name,
    applied: applied.filter(s => s.members.includes(name)).map(s => s.round),
    aborted: rounds.filter(s => s.decision === "abort" && s.members.includes(name)).map(s => s.round),
  })), { xLabel: "round" });
}

function renderEvents() {
  const list = document.getElementById("events");
  list.replaceChildren(...events.slice().reverse().map(e => {
    const li = document.createElement("li");
    const time = document.createElement("time");
    time.textContent = new Date(e.time * 1000).toLocaleTimeString();
    li.append(time, document.createTextNode(e.text));
    return li;
  }));
}

function renderBroadcast(status) {
  const body = document.querySelector("#broadcast tbody");
  body.replaceChildren(...(status.broadcast || []).map(b => {
    const tr = document.createElement("tr");
    tr.dataset.broadcast = b.kind + "/" + b.version;
    tr.append(cell(b.kind), cell(String(b.version), "num"),
              cell(new Date(b.published_at * 1000).toLocaleTimeString()), cell(fmt(b.bytes / 1e6, 1), "num"),
              cell(String(b.chunks), "num"), cell(b.root), cell(String(b.holders), "num"),
              cell(String(b.complete), "num"), cell(fmt(b.bytes_served / 1e6, 1), "num"),
              cell(b.banned.length ? b.banned.join(", ") : "–", b.banned.length ? "stale" : ""));
    return tr;
  }));
}

async function poll() {
  const connection = document.getElementById("connection");
  try {
    const [status, history] = await Promise.all([getJSON("/status"), getJSON("/v1/history?after=" + lastId)]);
    absorb(history);
    renderNodes(status);
    renderBroadcast(status);
    renderCharts();
    renderEvents();
    connection.textContent = "updated " + new Date().toLocaleTimeString();
    connection.className = "connection";
    const points = [...perNode.values()].reduce((n, s) => n + s.loss.length, 0);
    document.body.dataset.nodes = String(status.nodes.length);
    document.body.dataset.points = String(points);
    if (history.more) return setTimeout(poll, 0);  // catching up on a long history
  } catch (err) {
    connection.textContent = String(err.message || err) +
      (token ? "" : " (open this page as http://HOST:PORT/#token=JOIN_TOKEN)");
    connection.className = "connection error";
  }
  setTimeout(poll, POLL_MS);
}

poll();
