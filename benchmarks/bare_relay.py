"""The floor the proxy is measured against: a bare streaming relay, uvicorn
and httpx forwarding raw bytes to one worker, with no authentication, no
holds, no metering and no settlement. A raw ASGI app, so that no framework's
cost is counted as the relay's.

    python benchmarks/bare_relay.py --port 9100 --upstream http://127.0.0.1:9000
"""
from __future__ import annotations

import argparse

import httpx
import uvicorn

HOP_BY_HOP = {b"host", b"content-length", b"connection", b"transfer-encoding"}


def relay_app(upstream: str):
    client = httpx.AsyncClient(base_url=upstream, timeout=None, limits=httpx.Limits(max_connections=None))

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        headers = [(k, v) for k, v in scope["headers"] if k not in HOP_BY_HOP]
        request = client.build_request(scope["method"], scope["path"], content=body, headers=headers)
        response = await client.send(request, stream=True)
        try:
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": [(k, v) for k, v in response.headers.raw if k.lower() not in HOP_BY_HOP]})
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await response.aclose()

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    args = parser.parse_args()
    uvicorn.run(relay_app(args.upstream), host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
