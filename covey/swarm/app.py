"""HTTP for the swarm coordinator: signed JSON POSTs, status JSON and a static status page.

Every POST body is a model of covey.protocol.swarm (a malformed one is a 422 listing its
problems) and is authenticated for the endpoint it arrived at (covey.coordinator.auth's
ReceivedAt middleware, the same as a data-parallel coordinator's); `Rejected` becomes its
4xx with {"error": message}. The owner's HALT (POST /v1/halt), /healthz, /metrics, the
ledger routes and the rate and body-size limits are the coordinator's host parts
(covey.coordinator.host_app); once the run is halted every /v1/swarm POST is a 410.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse
from starlette.concurrency import run_in_threadpool

from covey.coordinator.host_app import handle_errors, host_middleware, host_routes, serve_app
from covey.coordinator.metrics import HostCollector, Metrics
from covey.coordinator.peer_routes import blob_routes, run_route
from covey.protocol.swarm import (
    SwarmDispute,
    SwarmHeartbeat,
    SwarmJoin,
    SwarmReport,
    SwarmRoundReport,
    SwarmStateUpload,
)
from covey.swarm import views
from covey.swarm.service import SwarmCoordinator

log = logging.getLogger("covey.swarm")
JOINS = frozenset({"/v1/swarm/join"})  # registers a new key (a ledger entry)

PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>covey swarm</title>
<style>body{font:14px system-ui;margin:2em}table{border-collapse:collapse}
td,th{border:1px solid #ccc;padding:3px 8px}</style></head><body>
<header id="covey-frame"></header><script src="/frame.js"></script>
<h1>covey swarm <span id="run"></span></h1><div id="totals"></div><div id="mult"></div>
<h2>Stages</h2><table id="stages"></table><h2>Servers</h2><table id="servers"></table>
<h2>Rebalances</h2><pre id="moves"></pre><h2>Disputes</h2><pre id="disputes"></pre>
<script>
function rows(el, head, data){el.innerHTML='<tr>'+head.map(h=>'<th>'+h+'</th>').join('')+
 '</tr>'+data.map(r=>'<tr>'+r.map(c=>'<td>'+c+'</td>').join('')+'</tr>').join('')}
async function tick(){const s=await (await fetch('/v1/swarm/status')).json();
 document.getElementById('run').textContent=s.name+' '+s.run_id;
 const t=Object.values(s.trainers);
 document.getElementById('totals').textContent='samples '+t.reduce((a,x)=>a+(x.samples||0),0)+
  ' | loss '+t.map(x=>x.loss==null?'-':x.loss.toFixed(3)).join(' ')+' | reroutes '+s.reroutes+
  ' | rebalances '+s.rebalances+' | banned '+s.banned.length;
 const c=s.costs||{},adds=Object.entries(c.adds||{}).filter(([,v])=>typeof v==='number'&&v>0.005);
 document.getElementById('mult').textContent='decentralization multiplier '+
  (typeof c.multiplier==='number'?c.multiplier.toFixed(2)+'\u00d7':'\u2014')+
  (adds.length?' ('+adds.map(([k,v])=>k+' +'+v.toFixed(2)).join(' \u00b7 ')+')':'');
 rows(document.getElementById('stages'),['stage','servers','samples/s','step','rounds'],
  s.stages.map((x,i)=>[x.stage,x.servers.join(', '),x.throughput,s.averaging[i].step,
  s.averaging[i].rounds]));
 rows(document.getElementById('servers'),['server','stage','samples/s (trainers)',
  'samples/s (its claim)','queue','step','served'],
  s.servers.map(x=>[x.name,x.stage,x.measured==null?'-':x.measured.toFixed(2),
  x.throughput.toFixed(2),x.queue,x.step,x.served]));
 document.getElementById('moves').textContent=s.moves.map(m=>m.server+': '+m.from+' -> '+m.to+
  ' ('+m.min_before+' -> '+m.min_after+')').join('\\n');
 document.getElementById('disputes').textContent=JSON.stringify(s.disputes,null,1);}
tick();setInterval(tick,1000);</script></body></html>"""


def create_app(coord: SwarmCoordinator) -> FastAPI:
    app = FastAPI(title="covey swarm", description="SWARM stage servers, trainers, rebalancing.")

    handle_errors(app, log)
    limits = coord.cfg.limits  # its max_json_bytes is the spec's max_body_bytes
    # live servers are the coordinator's in-memory set (heartbeats do not touch SQLite)
    live = HostCollector(coord.db, coord.cfg.dead_after_s, lambda: {"server": len(coord.servers)})
    metrics = Metrics(live, views.SwarmCollector(coord))
    host_routes(app, metrics, coord.halt, coord.accounts)  # /healthz, /metrics, /v1/halt...

    run_route(
        app,
        lambda: {
            "run_id": coord.run_id,
            "mode": "swarm",
            "coordinator_key": coord.identity.public_key,
            "owner_key": coord.halt.owner_key,
            "spec": coord.cfg.model_dump(mode="json"),
        },
    )

    # Signed requests: the signature covers the body exactly as sent, so each handler
    # passes the raw JSON along with the model FastAPI validated it into (a body the model
    # refuses is a 422 naming its problems, from handle_errors, and changes nothing).
    async def call(fn: Any, req: Any, request: Request) -> Any:
        raw = await request.json()
        coord.halt.check_not_halted()  # 410 with the owner's reason: the peer stops
        return await run_in_threadpool(fn, req, raw)

    @app.post("/v1/swarm/join")
    async def join(req: SwarmJoin, request: Request) -> Any:
        """A stage server or a trainer joins; a server gets its stage."""
        return await call(coord.join, req, request)

    @app.post("/v1/swarm/heartbeat")
    async def heartbeat(req: SwarmHeartbeat, request: Request) -> Any:
        """A server's state and load in; what it does next out (404: join again)."""
        return await call(coord.heartbeat, req, request)

    @app.post("/v1/swarm/round")
    async def round_report(req: SwarmRoundReport, request: Request) -> Any:
        """A member's gradient sum for its stage's open averaging round."""
        return await call(coord.round_report, req, request)

    @app.post("/v1/swarm/report")
    async def report(req: SwarmReport, request: Request) -> Any:
        """A trainer's progress, measurements of servers and evidence of agreed checks."""
        reply = await call(coord.trainer_report, req, request)
        coord.run_costs.note(req.peer_id, req.costs)  # a joined trainer's, authenticated
        return reply

    @app.post("/v1/swarm/dispute")
    async def dispute(req: SwarmDispute, request: Request) -> Any:
        """Two servers disagreed on one request: the referee recomputes it."""
        return await call(coord.dispute, req, request)

    @app.post("/v1/swarm/state")
    async def state(req: SwarmStateUpload, request: Request) -> Any:
        """A copy of a stage's agreed state, kept so the stage survives losing its servers."""
        return await call(coord.state_upload, req, request)

    blob_routes(app, coord.blobs)  # stage states kept by the coordinator

    @app.get("/v1/swarm/servers")
    def servers() -> Any:
        return views.servers_view(coord)

    @app.get("/v1/swarm/status")
    def status() -> Any:
        return views.status(coord)

    @app.get("/v1/swarm/spec")
    def spec() -> Any:
        return {"run_id": coord.run_id, "spec": coord.cfg.model_dump(mode="json")}

    @app.get("/", response_class=HTMLResponse)
    def page() -> str:
        return PAGE

    # bodies over the limit get 413 before a handler reads them; slow senders are cut off
    host_middleware(app, metrics, limits, json_limit=limits.max_json_bytes, joins=JOINS)
    return app


def serve(coord: SwarmCoordinator, host: str, port: int) -> None:
    """Run until SIGINT/SIGTERM, then stop the driver."""
    serve_app(create_app(coord), host, port, coord.cfg.limits, coord.start, coord.stop)
