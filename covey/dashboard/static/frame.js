// The frame every covey status page shares (rounds, RL, SWARM), served by the host at
// /frame.js: a bar naming the run and its mode, the owner's HALT when there is one, the
// signed ledger's length and head, live peers by role, and links to /docs, /metrics and
// the ledger. It fills <header id="covey-frame"> from GET /v1/run and GET /v1/host, and
// writes only text (textContent), so nothing a peer put in a name can add markup.
(function () {
  "use strict";
  const bar = document.getElementById("covey-frame");
  if (!bar) return;
  bar.style.cssText =
    "display:flex;flex-wrap:wrap;gap:0 1.2em;align-items:baseline;padding:6px 12px;" +
    "margin:0 0 1em;background:#1f2933;color:#e4e7eb;font:13px system-ui,sans-serif;" +
    "border-radius:6px";
  const part = (id, title) => {
    const el = document.createElement("span");
    el.id = id;
    if (title) el.title = title;
    bar.appendChild(el);
    return el;
  };
  const name = part("frame-run", "the run id: a hash of the spec, the data and the keys");
  const halt = part("frame-halt", "the run owner's signed HALT");
  const ledger = part("frame-ledger", "the signed ledger: entries and the last entry's hash");
  const live = part("frame-live", "peers heard from within dead_after_s");
  const links = document.createElement("span");
  links.style.marginLeft = "auto";
  for (const [href, text] of [["/docs", "API"], ["/metrics", "metrics"], ["/v1/ledger", "ledger"]]) {
    const a = document.createElement("a");
    a.href = href;
    a.textContent = text;
    a.style.cssText = "color:#9fd3ff;margin-left:.8em";
    links.appendChild(a);
  }
  bar.appendChild(links);
  let mode = "";
  fetch("/v1/run").then((r) => r.json()).then((run) => {
    mode = typeof run.mode === "string" ? run.mode : "rounds";
  }).catch(() => {});
  async function tick() {
    try {
      const h = await (await fetch("/v1/host")).json();
      name.textContent = `covey · ${mode || "…"} · run ${String(h.run_id)}`;
      if (h.halted && typeof h.halted === "object") {
        halt.textContent = `HALTED at ${String(h.halted.round)}: ${String(h.halted.reason)}`;
        halt.style.cssText = "color:#fff;background:#c62828;padding:0 6px;border-radius:3px";
      } else {
        halt.textContent = "";
        halt.style.cssText = "";
      }
      ledger.textContent = h.ledger
        ? `ledger ${Number(h.ledger.length).toLocaleString("en-US")} entries · head ${String(h.ledger.hash).slice(0, 12)}`
        : "ledger empty";
      const roles = h.live && typeof h.live === "object" ? Object.entries(h.live) : [];
      live.textContent = "live " + (roles.length
        ? roles.map(([role, n]) => `${Number(n)} ${role}${Number(n) === 1 ? "" : "s"}`).join(", ")
        : "none");
    } catch (e) {
      name.textContent = "covey · coordinator not answering";
    }
  }
  tick();
  setInterval(tick, 2000);
})();
