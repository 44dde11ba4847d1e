"""The simulated worker's command line (also `paralon sim-worker`)."""
from __future__ import annotations

import argparse

import uvicorn

from proxy.sim.worker import build_app

DEFAULT_PORT = 8100


def serve(host: str, port: int, profile: str, model: str, max_model_len: int | None = None, **behaviour) -> None:
    """Serves a simulated worker until interrupted; `behaviour` as build_app takes it."""
    uvicorn.run(
        build_app(profile, model, max_model_len=max_model_len, **behaviour),
        host=host,
        port=port,
        http="httptools",
        loop="uvloop",
        log_level="warning",
        access_log=False,
        lifespan="on",
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Simulated vLLM worker")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--profile", default="instant")
    parser.add_argument("--model", default="paralon-demo")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--inflate-usage", type=int, default=1, help="report usage multiplied by K (a dishonest worker)")
    parser.add_argument("--stop-after-tokens", type=int, default=None, help="stop every answer after N tokens")
    parser.add_argument("--fail-after-tokens", type=int, default=None, help="drop every stream after N tokens")
    parser.add_argument("--extra-tokens", type=int, default=0, help="generate N tokens past max_tokens")
    args = parser.parse_args(argv)
    serve(args.host, args.port, args.profile, args.model, args.max_model_len, inflate_usage=args.inflate_usage,
          stop_after_tokens=args.stop_after_tokens, fail_after_tokens=args.fail_after_tokens,
          extra_tokens=args.extra_tokens)


if __name__ == "__main__":
    main()
