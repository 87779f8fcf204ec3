// The dashboard's charts (uPlot). Data comes from the page itself or from /dashboard/api/*.
"use strict";
const dashboard = (() => {
  const width = (el) => Math.max(320, el.clientWidth || 800);

  // Loss curve of one run: x = optimizer step, y = summed loss:sum. Refreshed every 5 s.
  function loss(el, points, runId) {
    const columns = (pts) => [pts.map((p) => p.step), pts.map((p) => p.loss), pts.map((p) => p.eval_loss)];
    const series = [{ label: "step" }, { label: "loss:sum", stroke: "#1f6feb", width: 2, points: { show: true, size: 6 } }];
    const hasEval = points.some((p) => p.eval_loss !== null);
    const opts = { width: width(el), height: 280, scales: { x: { time: false } },
                   series: hasEval ? [...series, { label: "forward-only loss:sum", stroke: "#d9822b", width: 2, points: { show: true } }] : series,
                   axes: [{ label: "step", incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000] }, { label: "loss:sum" }] };
    const data = columns(points);
    window.lossChart = new uPlot(opts, hasEval ? data : data.slice(0, 2), el);
    setInterval(async () => {
      const answer = await fetch(`/dashboard/api/runs/${encodeURIComponent(runId)}/loss`, { credentials: "same-origin" });
      if (!answer.ok) return;
      const fresh = columns((await answer.json()).points);
      window.lossChart.setData(hasEval ? fresh : fresh.slice(0, 2));
    }, 5000);
  }

  // Live cycle utilisation: tokens per cycle (left axis); tenants per fused pass and queue depth (right axis).
  function cycles(el, statsEl) {
    const chart = new uPlot({
      width: width(el), height: 260,
      series: [{}, { label: "tokens per cycle", stroke: "#1f6feb", width: 2, scale: "tokens" },
               { label: "tenants per fused pass", stroke: "#2da44e", width: 2, scale: "count" },
               { label: "queue depth", stroke: "#d9822b", width: 2, scale: "count" }],
      axes: [{}, { scale: "tokens", label: "tokens" }, { scale: "count", side: 1, label: "tenants / queued", grid: { show: false } }],
    }, [[], [], [], []], el);
    window.cycleChart = chart;
    async function refresh() {
      const answer = await fetch("/dashboard/api/cycles", { credentials: "same-origin" });
      if (!answer.ok) return;
      const body = await answer.json();
      const c = body.cycles;
      chart.setData([c.map((x) => x.t), c.map((x) => x.tokens), c.map((x) => x.tenants), c.map((x) => x.queue_depth)]);
      const last = c.length ? c[c.length - 1] : null;
      statsEl.innerHTML = "";
      const stat = (label, value) => { const d = document.createElement("div"); const b = document.createElement("b");
        b.textContent = value; d.append(b, label); statsEl.append(d); };
      stat("queued now", body.queue_depth);
      stat("tokens, last cycle", last ? `${last.tokens} / ${body.max_tokens_per_cycle}` : "-");
      stat("tenants, last fused pass", last ? last.tenants : "-");
      stat("cycles shown", c.length);
    }
    refresh();
    setInterval(refresh, 2000);
  }

  return { loss, cycles };
})();
