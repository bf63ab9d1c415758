"""The trainer's status page: one self-contained HTML page polling /v1/rl/status."""

STATUS_HTML = """<!doctype html>
<html><head><meta charset="utf-8"><title>covey rl</title>
<style>body{font:14px system-ui,sans-serif;margin:2em;max-width:60em}
table{border-collapse:collapse}td,th{padding:2px 10px;border-bottom:1px solid #ddd;text-align:left}
svg{border:1px solid #ccc;background:#fafafa}</style></head>
<body><header id="covey-frame"></header><script src="/frame.js"></script>
<h1>covey rl <span id="run"></span></h1>
<p>model <b id="model">?</b> &middot; <span id="parameters">?</span> parameters</p>
<p>policy version <b id="version">?</b> &middot; batches accepted <b id="acc">0</b>,
rejected <b id="rej">0</b> &middot; audits <span id="audits"></span> &middot;
canaries <span id="canaries"></span> &middot; verified on <b id="verify"></b>
(<span id="judging"></span>)</p>
<p>decentralization multiplier <b id="mult">&mdash;</b> <span id="mult-parts"></span></p>
<h2>reward (per step) and pass@1 (held-out)</h2>
<svg id="plot" width="600" height="200"></svg>
<p><span style="color:#c60">&#9632; reward</span> <span style="color:#06c">&#9632; pass@1</span>
&middot; latest pass@1 <b id="pass">?</b></p>
<h2>rejections by reason</h2><table id="reasons"></table>
<h2>accounts</h2><table id="accounts"></table>
<script>
function line(points, color, maxX) {
  if (!points.length) return "";
  const xs = p => 10 + 580 * p[0] / Math.max(maxX, 1), ys = p => 190 - 180 * p[1];
  return '<polyline fill="none" stroke="' + color + '" stroke-width="2" points="' +
    points.map(p => xs(p) + "," + ys(p)).join(" ") + '"/>';
}
function esc(s) {
  return String(s).replace(/[&<>]/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;"}[c]));
}
async function tick() {
  try {
    const s = await (await fetch("/v1/rl/status")).json();
    document.getElementById("run").textContent = s.run_id;
    document.getElementById("model").textContent = s.model_name;
    const n = s.parameters, counts = document.getElementById("parameters");
    counts.textContent = n >= 1e9 ? (n / 1e9).toFixed(1) + "B" : n >= 1e6 ?
      (n / 1e6).toFixed(1) + "M" : n >= 1e3 ? (n / 1e3).toFixed(1) + "k" : String(n);
    counts.title = n.toLocaleString("en-US") + " parameters";
    document.getElementById("version").textContent = s.version;
    document.getElementById("verify").textContent = s.verify_device;
    document.getElementById("judging").textContent = (s.judging.startsWith("on ") ?
      "trainer judges " : "trainer does not judge: ") + s.judging;
    document.getElementById("acc").textContent = s.accepted;
    document.getElementById("rej").textContent = s.rejected;
    document.getElementById("audits").textContent = s.audits.audited + " audited, " +
      s.audits.caught + " caught";
    const k = s.canaries || {};
    document.getElementById("canaries").textContent = (k.caught || 0) + " caught, " +
      (k.convicted || 0) + " passed by a validator";
    const c = s.costs || {}, adds = c.adds || {};
    document.getElementById("mult").textContent = typeof c.multiplier === "number" ?
      c.multiplier.toFixed(2) + "\u00d7" : "\u2014";
    document.getElementById("mult-parts").textContent = Object.entries(adds)
      .filter(([, v]) => typeof v === "number" && v > 0.005)
      .map(([k, v]) => k + " +" + v.toFixed(2)).join(" \u00b7 ");
    const p = s.pass_at_1; document.getElementById("pass").textContent =
      p.length ? p[p.length - 1][1].toFixed(3) : "?";
    document.getElementById("plot").innerHTML = line(s.reward, "#c60", s.version) +
      line(p, "#06c", s.version);
    document.getElementById("reasons").innerHTML = "<tr><th>reason</th><th>batches</th></tr>" +
      Object.entries(s.rejected_by_reason).map(([k, v]) =>
        "<tr><td>" + esc(k) + "</td><td>" + v + "</td></tr>").join("");
    document.getElementById("accounts").innerHTML =
      "<tr><th>peer</th><th>name</th><th>role</th><th>stake</th><th>balance</th>" +
      "<th>tokens paid</th><th>banned</th></tr>" +
      Object.entries(s.accounts).map(([id, a]) => "<tr><td>" + id.slice(0, 12) + "</td><td>" +
        esc(a.name) + "</td><td>" + a.role + "</td><td>" + a.stake.toFixed(3) + "</td><td>" +
        a.balance.toFixed(4) + "</td><td>" + a.tokens_paid + "</td><td>" + a.banned +
        "</td></tr>").join("");
  } catch (e) { }
  setTimeout(tick, 2000);
}
tick();
</script></body></html>
"""
