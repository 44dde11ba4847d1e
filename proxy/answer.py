"""A non-streaming answer, put back together from the chunks of the stream
the caller would have received (the relay runs the same way for both)."""
from __future__ import annotations

import orjson

from proxy import sse

_DATA_PREFIX_BYTES = len(sse.DATA_PREFIX)


class AnswerParts:
    def __init__(self, *, chat: bool) -> None:
        self.chat = chat
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: dict[int, dict] = {}
        self.finish_reason: str | None = None
        self.error: dict | None = None

    def add(self, event: bytes) -> None:
        """One event of the caller's stream (as sse.encode wrote it)."""
        payload = event[_DATA_PREFIX_BYTES:].strip()
        if payload == sse.DONE:
            return
        chunk = orjson.loads(payload)
        if "error" in chunk:
            self.error = chunk["error"]
            return
        for choice in chunk.get("choices") or ():
            if self.chat:
                self._add_delta(choice.get("delta") or {})
            elif choice.get("text"):
                self.content.append(choice["text"])
            self.finish_reason = choice.get("finish_reason") or self.finish_reason

    def _add_delta(self, delta: dict) -> None:
        if isinstance(delta.get("content"), str):
            self.content.append(delta["content"])
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

    def assembled(self, request_id: str, created: int, model: str, usage: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": self._message(), "logprobs": None, "finish_reason": self.finish_reason}
            object_name = "chat.completion"
        else:
            choice = {"index": 0, "text": "".join(self.content), "logprobs": None, "finish_reason": self.finish_reason}
            object_name = "text_completion"
        return {"id": request_id, "object": object_name, "created": created, "model": model, "choices": [choice],
                "usage": usage}

    def _message(self) -> dict:
        message = {"role": "assistant", "content": "".join(self.content)}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
            message["content"] = message["content"] or None
        return message
