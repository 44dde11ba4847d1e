"""A non-streaming answer, put back together from the chunks of the stream
the caller would have received (the relay runs the same way for both): every
choice, in index order, with what its chunks carried (text, reasoning, tool
calls, refusal, logprobs)."""
from __future__ import annotations

import orjson

from proxy import sse

_DATA_PREFIX_BYTES = len(sse.DATA_PREFIX)
# The lists a completion's logprobs hold, one entry per token, concatenated across chunks.
COMPLETION_LOGPROB_KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
CHAT_LOGPROB_KEYS = ("content", "refusal")


class ChoiceParts:
    """One choice's pieces, in the order they came."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.refusal: list[str] = []
        self.tool_calls: dict[int, dict] = {}
        self.logprobs: dict[str, list] = {}
        self.finish_reason: str | None = None
        self.received = False

    def add(self, choice: dict) -> None:
        self.received = True
        if self.chat:
            self._add_delta(choice.get("delta") or {})
        elif isinstance(choice.get("text"), str):
            self.content.append(choice["text"])
        if isinstance(choice.get("logprobs"), dict):
            self._add_logprobs(choice["logprobs"])
        self.finish_reason = choice.get("finish_reason") or self.finish_reason

    def _add_delta(self, delta: dict) -> None:
        if isinstance(delta.get("content"), str):
            self.content.append(delta["content"])
        if isinstance(delta.get("refusal"), str):
            self.refusal.append(delta["refusal"])
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if isinstance(reasoning, str):
            self.reasoning.append(reasoning)
        for call in delta.get("tool_calls") or ():
            whole = self.tool_calls.setdefault(call.get("index", 0), {"id": None, "type": "function",
                                                                      "function": {"name": "", "arguments": ""}})
            whole["id"] = call.get("id") or whole["id"]
            function = call.get("function") if isinstance(call.get("function"), dict) else {}
            for key in ("name", "arguments"):
                if isinstance(function.get(key), str):
                    whole["function"][key] += function[key]

    def _add_logprobs(self, logprobs: dict) -> None:
        for key in CHAT_LOGPROB_KEYS if self.chat else COMPLETION_LOGPROB_KEYS:
            if isinstance(logprobs.get(key), list):
                self.logprobs.setdefault(key, []).extend(logprobs[key])

    def assembled(self, index: int) -> dict:
        logprobs = None
        if self.logprobs:
            keys = CHAT_LOGPROB_KEYS if self.chat else COMPLETION_LOGPROB_KEYS
            logprobs = {key: self.logprobs.get(key) if self.chat else self.logprobs.get(key, []) for key in keys}
        if not self.chat:
            return {"index": index, "text": "".join(self.content), "logprobs": logprobs, "finish_reason": self.finish_reason}
        return {"index": index, "message": self._message(), "logprobs": logprobs, "finish_reason": self.finish_reason}

    def _message(self) -> dict:
        refusal = "".join(self.refusal) or None
        message = {"role": "assistant", "content": "".join(self.content), "refusal": refusal}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        if self.tool_calls or refusal:  # only tool calls, or only a refusal: no text
            message["content"] = message["content"] or None
        return message


class AnswerParts:
    def __init__(self, *, chat: bool, choices: int = 1) -> None:
        self.chat = chat
        self.choices = [ChoiceParts(chat) for _ in range(choices)]
        self.error: dict | None = None

    def add(self, event: bytes) -> None:
        """One event of the caller's stream (as sse.encode wrote it): its
        choices were checked by the relay (indexes in range, each once)."""
        payload = event[_DATA_PREFIX_BYTES:].strip()
        if payload == sse.DONE:
            return
        chunk = orjson.loads(payload)
        if "error" in chunk:
            self.error = chunk["error"]
            return
        for choice in chunk.get("choices") or ():
            self.choices[choice.get("index", 0)].add(choice)

    def assembled(self, request_id: str, created: int, model: str, usage: dict) -> dict:
        object_name = "chat.completion" if self.chat else "text_completion"
        return {"id": request_id, "object": object_name, "created": created, "model": model,
                "choices": [parts.assembled(index) for index, parts in enumerate(self.choices)
                            if index == 0 or parts.received],  # a worker that ignored n: only what it sent
                "usage": usage}
