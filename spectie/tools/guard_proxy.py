"""The guard's two ways in: an OpenAI-compatible proxy (`spectie guard serve`) and a batch of requests
(`spectie guard run`). Both send every completion through `spectie.tools.guard.complete`."""

import json
import sys
from pathlib import Path

from spectie.records.errors import UsageError
from spectie.tools.guard import CHAT, COMPLETIONS, HEADER, Guard, Report, UpstreamError, complete


def header_value(response: dict) -> str:
    """What the proxy's `x-spectie-guard` header says about a response."""
    report = response.get("guard") or {}
    if not report.get("checked"):
        return f"unchecked: {report.get('reason', 'not a completion')}"
    return f"checked; resumed {len(report['resumed'])}"


def create_app(guard: Guard):
    """The proxy: /v1/completions and /v1/chat/completions through the guard (a streaming request is passed
    through unchecked, and its header says so); every other path passed through as it is."""
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.background import BackgroundTask
    from starlette.concurrency import run_in_threadpool

    app = FastAPI(title="spectie guard", description=__doc__)
    upstream = httpx.AsyncClient(base_url=guard.upstream, timeout=guard.timeout)

    async def passed_through(request: Request, path: str, reason: str):
        sent = upstream.build_request(request.method, path, content=await request.body(),
                                      headers={"content-type": request.headers.get("content-type", "application/json")},
                                      params=request.query_params)
        reply = await upstream.send(sent, stream=True)
        headers = {k: v for k, v in reply.headers.items() if k.lower() in ("content-type", "cache-control")}
        return StreamingResponse(reply.aiter_raw(), status_code=reply.status_code,
                                 headers={**headers, HEADER: f"unchecked: {reason}"}, background=BackgroundTask(reply.aclose))

    async def guarded(request: Request, path: str):
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            return JSONResponse({"error": f"the request is not JSON: {exc}"}, 400, {HEADER: "unchecked: not JSON"})
        if isinstance(body, dict) and body.get("stream"):
            return await passed_through(request, path, "streaming: the guard checks whole responses only")
        try:
            response = await run_in_threadpool(complete, guard, path, body)
        except UpstreamError as exc:
            return Response(exc.text, exc.status, media_type="application/json",
                            headers={HEADER: "unchecked: the upstream refused the request"})
        except UsageError as exc:
            return JSONResponse({"error": str(exc)}, 502, {HEADER: "unchecked: the upstream failed"})
        return JSONResponse(response, headers={HEADER: header_value(response)})

    @app.post(COMPLETIONS)
    async def completions(request: Request):
        return await guarded(request, COMPLETIONS)

    @app.post(CHAT)
    async def chat(request: Request):
        return await guarded(request, CHAT)

    @app.api_route("/{rest:path}", methods=["GET", "POST"])
    async def other(request: Request, rest: str):
        return await passed_through(request, "/" + rest, "not a completion")

    return app


def read_requests(path: str | Path) -> list[tuple[str, dict]]:
    """The requests of a JSONL file, each line a request body (a chat request has "messages"; anything else
    goes to /v1/completions) or {"path": ..., "body": ...}; every line checked before any is sent."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"no such file: {path}")
    requests = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except ValueError as exc:
            raise UsageError(f"{path}:{number}: not JSON ({exc})") from None
        if not isinstance(entry, dict):
            raise UsageError(f"{path}:{number}: a request is a JSON object")
        endpoint, body = (entry.get("path"), entry.get("body")) if "body" in entry else \
            (CHAT if "messages" in entry else COMPLETIONS, entry)
        if endpoint not in (COMPLETIONS, CHAT) or not isinstance(body, dict):
            raise UsageError(f"{path}:{number}: path must be {COMPLETIONS} or {CHAT} and body an object")
        requests.append((endpoint, body))
    if not requests:
        raise UsageError(f"{path}: no requests")
    return requests


def run_batch(guard: Guard, requests: list[tuple[str, dict]], out) -> dict:
    """Send every request through the guard, writing one response per line to `out`; returns the tally."""
    from tqdm.auto import tqdm

    tally = {"requests": 0, "resumed": 0, "extra_requests": 0, "unchecked": 0}
    for number, (path, body) in enumerate(tqdm(requests, desc="guard", unit="request", file=sys.stderr,
                                               disable=len(requests) < 2), 1):
        try:
            response = complete(guard, path, body)
        except UpstreamError as exc:
            if exc.status >= 500:  # the server failed: stop here, with what was answered before it written
                raise UsageError(f"request {number} of {len(requests)}: the upstream {guard.upstream} answered "
                                 f"{exc.one_line()}; {number - 1} response(s) written before it") from None
            response = {"error": exc.one_line(), "status": exc.status,  # refused: the client's error, as the proxy hands it back
                        "guard": Report(False, "the upstream refused the request").as_dict()}
        report = response["guard"]
        tally["requests"] += 1
        tally["resumed"] += bool(report["resumed"])
        tally["extra_requests"] += report["extra_requests"]
        tally["unchecked"] += not report["checked"]
        out.write(json.dumps(response) + "\n")
        out.flush()
    return tally
