"""A Responses request, read: what a worker gets, and the bound of its prompt.

An engine renders a Responses input with the model's chat template, as the
chat messages it converts it into (instructions a system turn, a message item
a turn, a `function_call` an assistant's tool call, a `function_call_output`
a tool reply). So the prompt is bounded as that chat request would be
(metering.prompt_tokens_bound), and a worker gets only what that bound
counted: each item rebuilt from the keys counted, function tools only, and
the few fields listed below. Reasoning items of earlier turns are not sent
back (templates drop them; nothing uncounted reaches the prompt)."""
from __future__ import annotations

from dataclasses import dataclass

from proxy import metering
from proxy.errors import InvalidRequest
from proxy.limits import MAX_TOKENS_LIMIT

RESPONSES = "responses"
ROLES = frozenset({"user", "assistant", "system", "developer"})
# Forwarded as given, each counted by the bound as its JSON.
COUNTED_FIELDS = ("tool_choice", "text", "reasoning")
# Shape what is sampled, never the prompt.
SAMPLING_FIELDS = ("temperature", "top_p", "parallel_tool_calls")
# Fields whose promise the proxy cannot keep: refused rather than ignored.
REFUSED_FIELDS = ("background", "conversation", "prompt")


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    model: str
    upstream_fields: dict  # what every worker gets, before the proxy's own fields (relay.py)
    input_items: list[dict]  # the whole input, earlier turns first, as forwarded
    chat_view: dict  # the chat request an engine renders: for routing affinity
    prompt_bound: int
    max_output_tokens: int | None
    streaming: bool
    store: bool  # keep its items for a follow-up (the worker is always told not to)
    previous_response_id: str | None


def read_request(body: dict, history: list[dict]) -> ResponsesRequest:
    """`history`: the stored items of the response named by previous_response_id."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model is required", param="model")
    for name in REFUSED_FIELDS:
        if body.get(name) not in (None, False):
            raise InvalidRequest(f"{name} is not supported", param=name)
    items = [*(item for item in map(_item_or_none, history) if item is not None), *_input_items(body.get("input"))]
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequest("instructions must be a string", param="instructions")
    tools = _function_tools(body.get("tools"))
    fields = {name: body[name] for name in (*COUNTED_FIELDS, *SAMPLING_FIELDS) if body.get(name) is not None}
    fields["input"] = items
    if instructions:
        fields["instructions"] = instructions
    if tools:
        fields["tools"] = tools
    chat_view = _chat_view(instructions, items, tools)
    if not chat_view["messages"]:
        raise InvalidRequest("input must not be empty", param="input")
    prompt_bound = metering.prompt_tokens_bound("chat", {**chat_view, "tool_choice": fields.get("tool_choice")})
    prompt_bound += sum(metering.json_bytes_bound(fields[name]) for name in ("text", "reasoning") if name in fields)
    return ResponsesRequest(model, fields, items, chat_view, prompt_bound, _max_output_tokens(body),
                            _flag(body, "stream", False), _flag(body, "store", True), body.get("previous_response_id"))


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be true or false", param=name)
    return value


def _max_output_tokens(body: dict) -> int | None:
    value = body.get("max_output_tokens")
    if value is not None and (type(value) is not int or not 1 <= value <= MAX_TOKENS_LIMIT):
        raise InvalidRequest(f"max_output_tokens must be an integer from 1 to {MAX_TOKENS_LIMIT}", param="max_output_tokens")
    return value


# The input

def _input_items(value: object) -> list[dict]:
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list):
        raise InvalidRequest("input must be a string or a list of items", param="input")
    items = []
    for index, item in enumerate(value):
        kept = _item(item, f"input[{index}]")
        if kept is not None:
            items.append(kept)
    return items


def _item_or_none(item: dict) -> dict | None:
    """A stored item (it was read once already; an output item may be of a kind not sent back)."""
    try:
        return _item(item, "previous_response_id")
    except InvalidRequest:
        return None


def _item(item: object, param: str) -> dict | None:
    """The item as a worker gets it: only the keys the bound counts."""
    if not isinstance(item, dict):
        raise InvalidRequest("each input item must be an object", param=param)
    kind = item.get("type", "message")
    if kind == "message":
        return _message(item, param)
    if kind == "function_call":
        return {"type": kind, "call_id": _text(item, "call_id", param), "name": _text(item, "name", param),
                "arguments": _text(item, "arguments", param)}
    if kind == "function_call_output":
        return {"type": kind, "call_id": _text(item, "call_id", param), "output": _output_text(item.get("output"), param)}
    if kind == "reasoning":
        return None
    raise InvalidRequest(f"input items of type {kind!r} are not supported", param=param)


def _message(item: dict, param: str) -> dict:
    role = item.get("role")
    if role not in ROLES:
        raise InvalidRequest(f"a message's role must be one of {sorted(ROLES)}", param=param + ".role")
    content = item.get("content")
    if isinstance(content, str):
        return {"type": "message", "role": role, "content": content}
    if not isinstance(content, list):
        raise InvalidRequest("a message's content must be a string or a list of parts", param=param + ".content")
    return {"type": "message", "role": role, "content": [_part(part, f"{param}.content") for part in content]}


def _part(part: object, param: str) -> dict:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("input_text", "output_text"):
        return {"type": kind, "text": _text(part, "text", param)}
    if kind == "refusal":
        return {"type": kind, "refusal": _text(part, "refusal", param)}
    raise InvalidRequest(f"content parts of type {kind!r} are not supported yet: send text parts only", param=param)


def _output_text(output: object, param: str) -> str:
    """A tool's output: a string, or text parts joined."""
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return "".join(_part(part, param + ".output").get("text", "") for part in output)
    raise InvalidRequest("a function_call_output needs its output as a string", param=param + ".output")


def _text(fields: dict, key: str, param: str) -> str:
    value = fields.get(key)
    if not isinstance(value, str):
        raise InvalidRequest(f"{key} must be a string", param=f"{param}.{key}")
    return value


def _function_tools(tools: object) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise InvalidRequest("tools must be a list", param="tools")
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise InvalidRequest("only function tools (with a name) are supported", param=f"tools[{index}]")
    return tools


# The chat request an engine renders it into

def _chat_view(instructions: str | None, items: list[dict], tools: list[dict]) -> dict:
    messages = [{"role": "system", "content": instructions}] if instructions else []
    messages += [_chat_message(item) for item in items]
    view: dict = {"messages": messages}
    if tools:
        view["tools"] = [{"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}} for tool in tools]
    return view


def _chat_message(item: dict) -> dict:
    kind = item["type"]
    if kind == "function_call":
        return {"role": "assistant", "content": None, "tool_calls": [
            {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}]}
    if kind == "function_call_output":
        return {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
    content = item["content"]
    if isinstance(content, list):
        content = [{"type": "refusal", "refusal": p["refusal"]} if p["type"] == "refusal" else {"type": "text", "text": p["text"]}
                   for p in content]
    return {"role": item["role"], "content": content}
