// The RL run's page: polls the orchestrator's /v1/rl/dashboard with the token from the URL's #fragment
// and draws what comes back. Holds every event it was sent, so each poll asks only for newer ones.
"use strict";

const token = new URLSearchParams(location.hash.slice(1)).get("token") || "";
const batches = [], evals = [], evictions = [];
let lastId = 0;

function fmt(v, digits) {
  return v === undefined || v === null ? "–" : (digits === undefined ? PrimeCharts.formatNumber(v) : v.toFixed(digits));
}

function esc(text) {
  return String(text).replace(/[&<>"']/g, c => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}

function renderSummary(run) {
  document.getElementById("env").textContent = `${run.environment}, async level ${run.async_level}`;
  const last = batches.length ? batches[batches.length - 1] : {};
  const lastEval = evals.length ? evals[evals.length - 1] : {};
  document.getElementById("summary").innerHTML =
    `<span>policy version <b>${run.newest_version}</b></span>` +
    `<span>trainer step <b>${run.next_step}</b></span>` +
    `<span>batch reward <b>${fmt(last.reward_mean, 3)}</b></span>` +
    `<span>held-out <b>${fmt(lastEval.eval_reward, 3)}</b></span>` +
    `<span>rollouts verified <b>${fmt(run.rollouts_accepted)}</b> rejected <b>${fmt(run.rollouts_rejected)}</b> ` +
    `stale <b>${fmt(run.rollouts_stale)}</b></span>` +
    `<span>groups filtered <b>${fmt(run.groups_filtered)}</b></span>` +
    `<span>${run.done ? "<b>finished</b>" : `running <b>${fmt(run.elapsed_s, 0)}</b> s`}</span>`;
}

function renderWorkers(workers, now) {
  document.querySelector("#workers tbody").innerHTML = workers.map(w => {
    const state = w.evicted ? "evicted" : (now - w.last_seen_s > 60 ? "gone" : "active");
    return `<tr><td>${esc(w.worker)}</td><td class="state-${state === "gone" ? "left" : state}">${state}</td>` +
      `<td class="num">${w.leases}</td><td class="num">${w.leases_held}</td><td class="num">${w.share}</td>` +
      `<td class="num">${w.verified}</td><td class="num">${w.rejected}</td><td class="num">${w.stale}</td>` +
      `<td class="num">${w.expired}</td><td class="num">${w.given_back}</td>` +
      `<td class="num">${fmt(w.verify_s, 1)}</td><td class="num">${fmt(now - w.last_seen_s, 0)} s ago</td></tr>`;
  }).join("");
}

function renderCharts() {
  PrimeCharts.lines(document.getElementById("reward-chart"), [
    { name: "batch mean", points: batches.map(b => [b.time_s, b.reward_mean]) },
    { name: "held-out", dots: true, color: PrimeCharts.PALETTE[1], points: evals.map(e => [e.time_s, e.eval_reward]) },
  ], { xLabel: "seconds", yZero: true });
  const rates = [];
  for (let i = 1; i < batches.length; i++) {
    const dt = batches[i].time_s - batches[i - 1].time_s;
    if (dt > 0) rates.push([batches[i].time_s, (batches[i].rollouts_accepted - batches[i - 1].rollouts_accepted) / dt]);
  }
  PrimeCharts.lines(document.getElementById("rate-chart"), [{ name: "verified / s", points: rates }],
    { xLabel: "seconds", yZero: true });
  PrimeCharts.lines(document.getElementById("staleness-chart"), [
    { name: "mean", points: batches.map(b => [b.step, b.staleness_mean]) },
    { name: "max", steps: true, points: batches.map(b => [b.step, b.staleness_max]) },
  ], { xLabel: "trainer step", yZero: true });
  const timed = batches.filter(b => b.leased_to_arrived_s !== undefined);
  PrimeCharts.lines(document.getElementById("path-chart"), [
    { name: "lease → back", points: timed.map(b => [b.step, b.leased_to_arrived_s]) },
    { name: "→ verified", points: timed.map(b => [b.step, b.arrived_to_verified_s]) },
    { name: "→ in the batch", points: timed.map(b => [b.step, b.verified_to_batch_s]) },
    { name: "request → built", points: timed.map(b => [b.step, b.asked_to_built_s]) },
  ], { xLabel: "trainer step", yZero: true });
  document.getElementById("events").innerHTML = evictions.map(e =>
    `<li><time>${fmt(e.time_s, 0)} s</time>${esc(e.worker)} evicted: ${esc(e.reason)}</li>`).join("") ||
    "<li>none</li>";
}

async function poll() {
  const connection = document.getElementById("connection");
  try {
    const response = await fetch("/v1/rl/dashboard", {
      method: "POST", headers: { "Content-Type": "application/json", "Authorization": `Bearer ${token}` },
      body: JSON.stringify({ after: lastId }) });
    const answer = await response.json();
    if (!response.ok) throw new Error(answer.error || `HTTP ${response.status}`);
    for (const e of answer.events) {
      ({ batch: batches, eval: evals, evicted: evictions })[e.event].push(e);
    }
    lastId = answer.last_id;
    renderSummary(answer.run);
    renderWorkers(answer.workers, answer.run.elapsed_s);
    renderCharts();
    connection.textContent = `updated ${new Date().toLocaleTimeString()}`;
    connection.className = "connection";
    document.body.dataset.loaded = "1";
  } catch (e) {
    connection.textContent = token ? `cannot read the run: ${e.message}` :
      "open this page as http(s)://HOST:PORT/#token=<a token of the run, e.g. an observer token>";
    connection.className = "connection error";
  }
}

poll();
setInterval(poll, 2000);
