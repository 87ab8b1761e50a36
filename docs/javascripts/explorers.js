/* The chapters' explorers, live on the static site. scripts/site_explorers.py writes each one's HTML: its
 * controls (each named by data-control, its description in the chapter), its readouts
 * (.minserve-widget-readout, in the widget's order) and its data as inline JSON. The page has no Python
 * kernel, so an explorer answers in one of two ways (data-mode):
 *   grid:  the build set the controls to each point of a grid and kept the readouts; the controls pick one.
 *   model: its arithmetic, written once below (the same formulas as minserve.capacity), runs here.
 * Nothing is fetched from anywhere: everything is in the page. */
(function () {
  "use strict";

  // --- the arithmetic explorers: (values by control description, data, root) -> {readouts, status} ----------

  // Chapter 08: speculation's speedup over k, (1 − α^(k+1)) / (1 − α) tokens a step over k·c + v step costs.
  function speculation(v, _data, root) {
    const a = Number(v["α"]), c = Number(v["draft cost c"]), cost = Number(v["verify cost v"]);
    const ks = [1, 2, 3, 4, 5, 6, 7, 8];
    const tokens = (k) => (a === 1 ? k + 1 : (1 - a ** (k + 1)) / (1 - a));
    const speedup = ks.map((k) => tokens(k) / (k * c + cost));
    const chart = root.querySelector(".js-plotly-plot");  // the chapter's figure: redraw its predicted curve
    const name = `predicted: α=${a.toFixed(2)}, c=${c.toFixed(2)}, v=${cost.toFixed(2)}`;
    if (chart && window.Plotly) window.Plotly.restyle(chart, { x: [ks], y: [speedup], name: [name] }, [0]);
    const best = speedup.indexOf(Math.max(...speedup));
    const verdict = speedup[best] > 1 ? "pays" : "does not pay: plain decoding is faster";
    return { status: `α=${a.toFixed(2)}, c=${c.toFixed(2)}, v=${cost.toFixed(2)}: best k = ${ks[best]}, ` +
                     `${speedup[best].toFixed(2)}× plain decoding (speculation ${verdict})` };
  }

  // Decimal units, as accelerator memory is sold (minserve.lab.kv.format_bytes).
  function formatBytes(n) {
    const sign = n < 0 ? "−" : "";
    n = Math.abs(n);
    for (const unit of ["B", "kB", "MB", "GB"]) {
      if (n < 1000) return unit === "B" ? `${sign}${n.toFixed(0)} B` : `${sign}${n.toFixed(1)} ${unit}`;
      n /= 1000;
    }
    return `${sign}${n.toFixed(1)} TB`;
  }

  // Chapter 04: minserve.capacity.fit, from the bytes the build exported per model and dtype.
  function kvCalculator(v, data) {
    const model = data.models[v["model"]];
    if (!model) return { status: `${v["model"]} is sized in JupyterLab only (make lab)` };
    const context = Math.max(1, parseInt(v["context"], 10) || 1), batch = Math.max(1, parseInt(v["batch"], 10) || 1);
    const block = data.block_size, perToken = model.kv_per_token[v["KV cache"]];
    const weights = model.weights[v["weights"]], gpu = data.gpus[v["GPU"]];
    const usable = Math.floor(gpu * data.utilization);
    const perRequest = Math.ceil(context / block) * block * perToken;  // whole blocks of the paged cache
    const kv = batch * perRequest, fits = weights + kv <= usable;
    const blocks = Math.floor(Math.max(usable - weights, 0) / (block * perToken));
    const rows = [
      ["KV per token", `${perToken.toLocaleString("en-US")} B`], ["KV per request", formatBytes(perRequest)],
      ["KV for the batch", formatBytes(kv)], ["weights", formatBytes(weights)], ["usable memory", formatBytes(usable)],
      ["headroom", formatBytes(usable - weights - kv)],
      ["max batch at this context", Math.floor(blocks / Math.ceil(context / block)).toLocaleString("en-US")],
    ];
    const body = rows.map(([k, x]) => `<tr><td style='padding:0 12px'>${k}</td><td style='text-align:right'>${x}</td></tr>`);
    const verdict = `<p style='color:${fits ? "#009E73" : "#D55E00"};font-weight:bold'>${fits ? "fits" : "does not fit"}</p>`;
    return { readouts: [`<table>${body.join("")}</table>${verdict}`],
             status: `${v["model"]}, ${batch} × ${context} tokens on ${v["GPU"]}: computed in this page` };
  }

  // Python's format(x, ".3g"): `digits` significant digits, trailing zeros dropped, exponent from 1e-4 / 1e+digits.
  function formatG(x, digits) {
    if (x === 0 || !isFinite(x)) return String(x);
    const exponent = Number(x.toExponential(digits - 1).split("e")[1]);  // after rounding to `digits`
    if (exponent < -4 || exponent >= digits) {
      const [mantissa, e] = x.toExponential(digits - 1).split("e");
      const m = mantissa.includes(".") ? mantissa.replace(/0+$/, "").replace(/\.$/, "") : mantissa;
      return `${m}e${e[0] === "-" ? "-" : "+"}${String(Math.abs(Number(e))).padStart(2, "0")}`;
    }
    const fixed = x.toFixed(Math.max(0, digits - 1 - exponent));
    return fixed.includes(".") ? fixed.replace(/0+$/, "").replace(/\.$/, "") : fixed;
  }

  // minserve.lab.roofline_widget.format_seconds.
  function formatSeconds(s) {
    for (const [unit, scale] of [["s", 1], ["ms", 1e-3], ["µs", 1e-6]]) {
      if (Math.abs(s) >= scale) return unit === "s" ? `${formatG(s / scale, 3)} ${unit}` : `${(s / scale).toFixed(2)} ${unit}`;
    }
    return `${(s * 1e9).toFixed(1)} ns`;
  }

  const thousands = (x, digits) => x.toLocaleString("en-US", { minimumFractionDigits: digits, maximumFractionDigits: digits });

  // Chapter 03: minserve.lab.roofline_widget.roofline_explorer_result, from the terms the build exported
  // (roofline_page_data): a step's time is max(FLOPs / peak, bytes / bandwidth), whichever roof binds.
  function roofline(v, data) {
    const m = data.models[v["model"]], hw = data.hardware[v["hardware"]];
    if (!m || !hw) return { status: `${v["model"]} on ${v["hardware"]} is predicted in JupyterLab only (make lab)` };
    const batch = parseInt(v["batch"], 10), context = parseInt(v["context"], 10);
    if (!(batch >= 1 && context >= 1)) {
      return { readouts: [`<p style='color:#D55E00'>batch and context must be positive, got ${v["batch"]} and ${v["context"]}</p>`],
               status: "" };
    }
    const bytesPer = data.dtype_bytes[hw.dtype];
    // A pass of `tokens` tokens reads every dense matrix once and, in a sparse layer, the experts some token
    // chose: E·(1 − (1 − k/E)^tokens) of them (minserve.capacity.roofline.experts_touched).
    const touched = (tokens) => (m.sparse_layers ? m.experts * (1 - (1 - m.experts_per_token / m.experts) ** tokens) : 0);
    const weightsRead = (tokens) => Math.round((m.read_params_fixed + m.sparse_layers * touched(tokens) * m.expert_params
                                                + m.head_params) * bytesPer);
    // Causal query-key pairs of the last `queries` of `n` tokens, each key seen within the sliding window.
    const visible = (n) => (m.window === null || n <= m.window ? n * (n + 1) / 2 : m.window * (m.window + 1) / 2 + (n - m.window) * m.window);
    const pairs = (queries, n) => visible(n) - visible(n - queries);
    const kvPerToken = m.kv_elements_per_token * bytesPer;
    const step = (flops, bytes) => {
      const compute = flops / hw.peak, memory = bytes / hw.bandwidth;
      return { flops, bytes, compute, memory, time: Math.max(compute, memory), bound: compute >= memory ? "compute" : "memory" };
    };
    const decode = step(batch * (m.flops_per_token + m.attention_flops_per_pair * pairs(1, context)),
                        weightsRead(batch) + batch * context * kvPerToken);
    const prefill = step(2 * m.matmul_params * context + 2 * m.head_params + m.attention_flops_per_pair * pairs(context, context),
                         weightsRead(context) + context * kvPerToken);
    const ridge = hw.peak / hw.bandwidth, needed = m.params * bytesPer + context * batch * kvPerToken;
    const rows = [
      ["decode step", formatSeconds(decode.time)],
      ["  of which compute / memory", `${formatSeconds(decode.compute)} / ${formatSeconds(decode.memory)}`],
      ["decode intensity / ridge", `${formatG(decode.flops / decode.bytes, 3)} / ${formatG(ridge, 3)} FLOP/byte`],
      ["tokens/s, whole batch", thousands(batch / decode.time, 0)],
      ["tokens/s, each sequence", thousands(1 / decode.time, 1)],
      ["critical batch", (ridge * bytesPer / 2).toFixed(0)],
      [`prefill of ${context} tokens`, `${formatSeconds(prefill.time)} (${prefill.bound}-bound)`],
      ["weights + KV / memory", `${(needed / 1e9).toFixed(1)} / ${(hw.memory / 1e9).toFixed(0)} GB`],
    ];
    const body = rows.map(([k, x]) => `<tr><td style='padding:0 12px'>${k}</td><td style='text-align:right'>${x}</td></tr>`);
    const colour = decode.bound === "compute" ? "#009E73" : "#0072B2";
    let html = `<table>${body.join("")}</table><p style='color:${colour};font-weight:bold'>decode is ${decode.bound}-bound on ${hw.name} in ${hw.dtype}</p>`;
    if (needed > hw.memory) html += "<p style='color:#D55E00'>the weights and this batch's KV cache do not fit in memory</p>";
    return { readouts: [html], status: `${v["model"]}, batch ${batch} at ${context} tokens on ${hw.name}: computed in this page` };
  }

  const MODELS = { "speculation": speculation, "kv-calculator": kvCalculator, "roofline": roofline };

  // --- the built grid: the controls' positions name a point; its readouts were recorded at build time --------

  function gridAnswer(root, data) {
    const positions = data.controls.map((name, i) => {
      const el = root.querySelector(`[data-control="${CSS.escape(name)}"]`);
      if (el.tagName === "SELECT") return data.values[i].indexOf(el.selectedIndex);
      if (el.type === "checkbox") return data.values[i].indexOf(el.checked);
      const x = Number(el.value);  // a slider: the nearest value on the grid
      const gaps = data.values[i].map((g) => Math.abs(g - x));
      return gaps.indexOf(Math.min(...gaps));
    });
    const row = data.index[positions.join(",")];
    if (row === undefined) {
      return { status: "This combination was not built (the grid moves one control at a time from the " +
                       "chapter's setting): run the chapter in JupyterLab for it." };
    }
    return { readouts: data.readouts[row], status: `A built result, ${row + 1} of ${data.readouts.length} distinct.` };
  }

  // --- wiring -----------------------------------------------------------------------------------------------

  function values(root) {
    const out = {};
    root.querySelectorAll("[data-control]").forEach((el) => {
      out[el.dataset.control] = el.tagName === "SELECT" ? el.options[el.selectedIndex].text
        : el.type === "checkbox" ? el.checked : el.value;
    });
    return out;
  }

  // innerHTML does not run scripts; a built readout's chart draws from its own script, so run each anew.
  function setHtml(el, html) {
    el.innerHTML = html;
    el.querySelectorAll("script").forEach((old) => {
      const script = document.createElement("script");
      script.text = old.text;
      old.replaceWith(script);
    });
  }

  function init(root) {
    const data = JSON.parse(root.querySelector("script.minserve-explorer-data").textContent);
    const readouts = [...root.querySelectorAll(".minserve-widget-readout")];
    const original = readouts.map((r) => r.innerHTML);  // what the chapter left: a grid's null means this
    const status = root.querySelector(".minserve-explorer-status");
    const update = () => {
      const answer = root.dataset.mode === "grid" ? gridAnswer(root, data)
        : MODELS[root.dataset.explorer](values(root), data, root);
      (answer.readouts || []).forEach((html, i) => {
        if (readouts[i] && html !== undefined) setHtml(readouts[i], html === null ? original[i] : html);
      });
      status.textContent = answer.status || "";
    };
    root.querySelectorAll("[data-control]").forEach((el) => {
      const shown = el.parentElement.querySelector("output");  // a slider's value beside it
      const changed = () => { if (shown) shown.textContent = el.value; update(); };
      el.addEventListener("input", changed);
      el.addEventListener("change", changed);
    });
    root.dataset.ready = "true";  // for the site test: the controls now answer
  }

  document.querySelectorAll(".minserve-explorer").forEach(init);
})();
