"""The simulated worker's POST /tokenize, as vLLM answers it.

{"model", "messages"} (chat) or {"model", "prompt"} (completions) is answered
{"count", "max_model_len", "tokens"}, the count being exactly the prompt_tokens
its usage reports for the same prompt (proxy/sim/requests.py).

For tests of a worker that lies: `count_percent` scales every count it
answers (25 counts a quarter of the prompt, 400 four times it); its usage
stays honest. `calls` counts the requests it answered. Reach both through
`tokenize_route(app)`.
"""
from __future__ import annotations

from typing import Any

import orjson

from ledger.money import PERCENT
from proxy.sim.emitters import JSON_HEADERS, send_body
from proxy.sim.requests import HttpError, bad_request, chat_prompt, count_prompt_tokens

# The worker (proxy/sim/worker.py) and ASGI's scope, receive and send: it
# imports this module, so their types are not imported here.
SimWorker = Scope = Receive = Send = Any


class TokenizeRoute:
    """An ASGI handler of the worker's routes table."""

    def __init__(self, worker: SimWorker) -> None:
        self.worker = worker
        self.count_percent = PERCENT
        self.calls = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            count = self.prompt_tokens(orjson.loads(await _read_body(receive)))
        except HttpError as error:
            await send_body(send, error.status, error.body(), JSON_HEADERS)
            return
        except orjson.JSONDecodeError:
            await send_body(send, 400, bad_request("the request body is not valid JSON").body(), JSON_HEADERS)
            return
        self.calls += 1
        count = count * self.count_percent // PERCENT
        answer = {"count": count, "max_model_len": self.worker.max_model_len, "tokens": [0] * count}
        await send_body(send, 200, orjson.dumps(answer), JSON_HEADERS)

    def prompt_tokens(self, data: Any) -> int:
        """What the worker's usage reports for this prompt."""
        if not isinstance(data, dict):
            raise bad_request("the request body must be a JSON object")
        if "messages" in data:
            contents, _ = chat_prompt(data["messages"])
            if data.get("tools"):
                contents.append(orjson.dumps(data["tools"]))
            return count_prompt_tokens(contents)
        prompt = data.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise bad_request("prompt must be a string or a list of strings")
        return count_prompt_tokens([prompt.encode()])


def tokenize_route(app: SimWorker) -> TokenizeRoute:
    """The /tokenize handler of a simulated worker, for a test to read or set."""
    return app._routes["/tokenize"][1]


async def _read_body(receive: Receive) -> bytes:
    parts = []
    while True:
        message = await receive()
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts)
