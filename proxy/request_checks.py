"""A chat or completions body checked against OpenAI's API document
(CreateChatCompletionRequest, CreateCompletionRequest) before anything is
held: the fields OpenAI defines have its types, ranges and values, and each
message has what its role needs. A mistake is a 400 whose `param` names the
field, in OpenAI's words (`invalid_type`, `missing_required_parameter`, ...).

What this does not check, someone else does: the prompt's shape that the bound
counts (a message's role and content types, content parts, tool calls being
objects: metering.prompt_tokens_bound), max_tokens' range (metering), the model
(the directory). Fields OpenAI does not define (vLLM's top_k, min_p,
guided_json, ...) are left to the engine; forwarded_fields decides which reach
it. A null stands for an absent field, as the SDKs send it.

Plain checks over the fields the body has, so that a typical agent body costs
a few microseconds (benchmarks/request_checks.py)."""
from __future__ import annotations

from collections.abc import Callable

from proxy.errors import InvalidRequest
from proxy.limits import (
    OPENAI_BEST_OF_MAX,
    OPENAI_CHOICES_MAX,
    OPENAI_COMPLETION_LOGPROBS_MAX,
    OPENAI_LOGIT_BIAS_MAX,
    OPENAI_PENALTY_MAX,
    OPENAI_SEED_MAX,
    OPENAI_SEED_MIN,
    OPENAI_TEMPERATURE_MAX,
    OPENAI_TOP_LOGPROBS_MAX,
)

# Where a value sits: a field's name, or (where its parent sits, a key or an
# index). Written out only when something is refused, so that the checks of a
# body that passes build no strings.
Where = str | tuple
Check = Callable[[object, Where], None]

_JSON_TYPE = {bool: "a boolean", int: "an integer", float: "a decimal", str: "a string", list: "an array",
              dict: "an object", type(None): "null"}


# --- What a refusal says ----------------------------------------------------------

def _text(where: Where) -> str:
    """`messages[2].tool_calls[0].function` from its nested form."""
    if type(where) is str:
        return where
    parent, step = where
    return f"{_text(parent)}[{step}]" if type(step) is int else f"{_text(parent)}.{step}"


def _wrong_type(where: Where, expected: str, value: object) -> InvalidRequest:
    param = _text(where)
    got = _JSON_TYPE.get(type(value), "something else")
    return InvalidRequest(f"Invalid type for '{param}': expected {expected}, but got {got} instead.",
                          param=param, code="invalid_type")


def _missing(where: Where, blamed: Where | None = None) -> InvalidRequest:
    """`blamed`: the object the caller must complete, when it is not the field itself."""
    return InvalidRequest(f"Missing required parameter: '{_text(where)}'.", param=_text(blamed or where),
                          code="missing_required_parameter")


def _not_one_of(where: Where, allowed: tuple[str, ...], value: object) -> InvalidRequest:
    param = _text(where)
    listed = ", ".join(f"'{a}'" for a in allowed)
    return InvalidRequest(f"Invalid value for '{param}': expected one of {listed}, but got {value!r} instead.",
                          param=param, code="invalid_value")


def _out_of_range(where: Where, value: float, low: float | None, high: float | None, kind: str) -> InvalidRequest:
    param = _text(where)
    if low is not None and value < low:
        return InvalidRequest(f"Invalid '{param}': {kind} below minimum value. Expected a value >= {low}, but got {value} "
                              "instead.", param=param, code=f"{kind}_below_min_value")
    return InvalidRequest(f"Invalid '{param}': {kind} above maximum value. Expected a value <= {high}, but got {value} "
                          "instead.", param=param, code=f"{kind}_above_max_value")


def _empty(where: Where) -> InvalidRequest:
    param = _text(where)
    return InvalidRequest(f"Invalid '{param}': empty array. Expected an array with minimum length 1, but got an empty "
                          "array instead.", param=param, code="empty_array")


# --- One value ------------------------------------------------------------------

def _boolean(value: object, param: Where) -> None:
    if type(value) is not bool:
        raise _wrong_type(param, "a boolean", value)


def _string(value: object, param: Where) -> None:
    if type(value) is not str:
        raise _wrong_type(param, "a string", value)


def _object(value: object, param: Where) -> None:
    if type(value) is not dict:
        raise _wrong_type(param, "an object", value)


def _integer(low: int | None = None, high: int | None = None) -> Check:
    def check(value: object, param: Where) -> None:
        if type(value) is not int:
            raise _wrong_type(param, "an integer", value)
        if (low is not None and value < low) or (high is not None and value > high):
            raise _out_of_range(param, value, low, high, "integer")
    return check


def _number(low: float, high: float) -> Check:
    def check(value: object, param: Where) -> None:
        if type(value) is not int and type(value) is not float:
            raise _wrong_type(param, "a number", value)
        if not low <= value <= high:
            raise _out_of_range(param, value, low, high, "decimal")
    return check


def _one_of(*allowed: str) -> Check:
    def check(value: object, param: Where) -> None:
        if type(value) is not str or value not in allowed:
            raise _not_one_of(param, allowed, value)
    return check


def _map_of(item: Check) -> Check:
    def check(value: object, param: Where) -> None:
        _object(value, param)
        for key, entry in value.items():
            item(entry, (param, key))
    return check


def _array_of(item: Check, *, non_empty: bool = False) -> Check:
    def check(value: object, param: Where) -> None:
        if type(value) is not list:
            raise _wrong_type(param, "an array", value)
        if non_empty and not value:
            raise _empty(param)
        for index, entry in enumerate(value):
            item(entry, (param, index))
    return check


def _typed_object(kinds: dict[str, Callable[[dict, str], None]]) -> Check:
    """An object whose `type` says which shape it has (`kinds`: type -> its own check)."""
    allowed = tuple(kinds)

    def check(value: object, param: Where) -> None:
        _object(value, param)
        kind = value.get("type")
        if kind is None:
            raise _missing((param, "type"))
        if type(kind) is not str or kind not in kinds:
            raise _not_one_of((param, "type"), allowed, kind)
        kinds[kind](value, param)
    return check


def _required(fields: dict, param: Where, name: str, check: Check) -> None:
    value = fields.get(name)
    if value is None:
        raise _missing((param, name))
    check(value, (param, name))


def _optional(fields: dict, param: Where, name: str, check: Check) -> None:
    value = fields.get(name)
    if value is not None:
        check(value, (param, name))


def _nothing(value: dict, param: Where) -> None:
    return None


# --- Fields of both routes ----------------------------------------------------------

def _stop(value: object, param: Where) -> None:
    if type(value) is str:
        return
    _array_of(_string)(value, param)


def _stream_options(value: object, param: Where) -> None:
    _object(value, param)
    for name in ("include_usage", "include_obfuscation", "continuous_usage_stats"):  # the last is vLLM's
        _optional(value, param, name, _boolean)


_penalty = _number(-OPENAI_PENALTY_MAX, OPENAI_PENALTY_MAX)

COMMON_FIELDS: dict[str, Check] = {
    "model": _string,
    "stream": _boolean,
    "stream_options": _stream_options,
    "n": _integer(1, OPENAI_CHOICES_MAX),
    "max_tokens": _integer(),  # its range is metering's (requested_max_tokens)
    "max_completion_tokens": _integer(),
    "temperature": _number(0, OPENAI_TEMPERATURE_MAX),
    "top_p": _number(0, 1),
    "frequency_penalty": _penalty,
    "presence_penalty": _penalty,
    "seed": _integer(OPENAI_SEED_MIN, OPENAI_SEED_MAX),
    "stop": _stop,
    "logit_bias": _map_of(_number(-OPENAI_LOGIT_BIAS_MAX, OPENAI_LOGIT_BIAS_MAX)),
    "user": _string,
    "safety_identifier": _string,
    "prompt_cache_key": _string,
    "prompt_cache_retention": _one_of("in_memory", "24h"),
    "metadata": _map_of(_string),
    "service_tier": _one_of("auto", "default", "flex", "scale", "priority", "fast"),
}


# --- Chat: tools, formats, messages -----------------------------------------------------

def _function_definition(function: dict, param: Where) -> None:
    _required(function, param, "name", _string)
    _optional(function, param, "description", _string)
    _optional(function, param, "parameters", _object)
    _optional(function, param, "strict", _boolean)


def _function_object(function: object, param: Where) -> None:
    _object(function, param)
    _function_definition(function, param)


def _function_tool(tool: dict, param: Where) -> None:
    _required(tool, param, "function", _object)
    _function_definition(tool["function"], (param, "function"))


def _custom_tool(tool: dict, param: Where) -> None:
    _required(tool, param, "custom", _object)
    _required(tool["custom"], (param, "custom"), "name", _string)


def _named_function(choice: dict, param: Where) -> None:
    _required(choice, param, "function", _object)
    _required(choice["function"], (param, "function"), "name", _string)


def _named_custom(choice: dict, param: Where) -> None:
    _required(choice, param, "custom", _object)
    _required(choice["custom"], (param, "custom"), "name", _string)


def _allowed_tools(choice: dict, param: Where) -> None:
    _required(choice, param, "allowed_tools", _object)


_tool = _typed_object({"function": _function_tool, "custom": _custom_tool})


def _tools(value: object, where: Where) -> None:
    """Every tool; the usual function tool passes without the walk that names what is wrong."""
    if type(value) is not list:
        raise _wrong_type(where, "an array", value)
    for index, tool in enumerate(value):
        function = tool.get("function") if type(tool) is dict and tool.get("type") == "function" else None
        if type(function) is not dict or not _plain_function(function):
            _tool(tool, (where, index))


def _plain_function(function: dict) -> bool:
    description, parameters, strict = function.get("description"), function.get("parameters"), function.get("strict")
    return (type(function.get("name")) is str and (description is None or type(description) is str)
            and (parameters is None or type(parameters) is dict) and (strict is None or type(strict) is bool))


_tool_choice_object = _typed_object({"function": _named_function, "custom": _named_custom, "allowed_tools": _allowed_tools})
_tool_choice_modes = _one_of("none", "auto", "required")


def _tool_choice(value: object, param: Where) -> None:
    (_tool_choice_modes if type(value) is str else _tool_choice_object)(value, param)


def _function_call(value: object, param: Where) -> None:
    if type(value) is str:
        _one_of("none", "auto")(value, param)
        return
    _object(value, param)
    _required(value, param, "name", _string)


def _json_schema_format(value: dict, param: Where) -> None:
    _required(value, param, "json_schema", _object)
    schema_param = (param, "json_schema")
    _required(value["json_schema"], schema_param, "name", _string)
    _optional(value["json_schema"], schema_param, "schema", _object)
    _optional(value["json_schema"], schema_param, "strict", _boolean)


_response_format = _typed_object({
    "text": _nothing, "json_object": _nothing, "json_schema": _json_schema_format,
    "structural_tag": _nothing,  # vLLM's own; the engine checks the rest
})

ROLES = ("developer", "system", "user", "assistant", "tool", "function")
_KNOWN_ROLES = frozenset(ROLES)
_CONTENT_REQUIRED = frozenset({"developer", "system", "user", "tool"})
_function_type = _one_of("function")


def _tool_call(call: object, where: Where) -> None:
    if type(call) is not dict:
        return  # metering refuses it with its own words
    if type(call.get("id")) is not str or call.get("type") != "function":
        _required(call, where, "id", _string)
        _required(call, where, "type", _function_type)
    function = call.get("function")
    if type(function) is dict and (type(function.get("name")) is not str or type(function.get("arguments")) is not str):
        _required(function, (where, "function"), "name", _string)
        _required(function, (where, "function"), "arguments", _string)


def _message(message: object, index: int) -> None:
    """What OpenAI's schema of each role requires; the types metering counts it by are its own."""
    if type(message) is not dict:
        return  # metering: "each message needs a role"
    role = message.get("role")
    if type(role) is not str:
        return
    where = ("messages", index)
    if role not in _KNOWN_ROLES:
        raise _not_one_of((where, "role"), ROLES, role)
    content = message.get("content")
    if content is None:
        _no_content(message, role, where)
    elif type(content) is list and not content:
        raise _empty((where, "content"))
    name = message.get("name")
    if name is not None and type(name) is not str:
        raise _wrong_type((where, "name"), "a string", name)
    if role == "assistant":
        calls = message.get("tool_calls")
        if type(calls) is list:
            for number, call in enumerate(calls):
                _tool_call(call, ((where, "tool_calls"), number))
    elif role == "tool":
        _required(message, where, "tool_call_id", _string)
    elif role == "function":
        _required(message, where, "name", _string)


def _no_content(message: dict, role: str, where: Where) -> None:
    """Content absent or null: only an assistant's tool calls, or a function's explicit null, stand in for it."""
    if role in _CONTENT_REQUIRED or (role == "function" and "content" not in message):
        raise _missing((where, "content"), where)
    if role == "assistant" and not message.get("tool_calls") and message.get("function_call") is None:
        raise InvalidRequest(f"Missing required parameter: '{_text((where, 'content'))}' (an assistant message needs "
                             "content or tool_calls).", param=_text(where), code="missing_required_parameter")


def _messages(value: object, where: Where) -> None:
    if type(value) is list:  # anything else: metering says "messages must be a non-empty list"
        for index, message in enumerate(value):
            if not _plain_message(message):
                _message(message, index)


_TEXT_ROLES = frozenset({"developer", "system", "user"})


def _plain_message(message: object) -> bool:
    """The messages of most bodies, passed without the walk that would name what is wrong."""
    if type(message) is not dict:
        return False
    role, content, name = message.get("role"), message.get("content"), message.get("name")
    if name is not None and type(name) is not str:
        return False
    if role == "assistant":
        calls = message.get("tool_calls")
        if calls is None:
            return type(content) is str
        return (content is None or type(content) is str) and type(calls) is list and bool(calls) and all(map(_plain_call, calls))
    if type(content) is not str:
        return False
    return role in _TEXT_ROLES or (role == "tool" and type(message.get("tool_call_id")) is str)


def _plain_call(call: object) -> bool:
    if type(call) is not dict or type(call.get("id")) is not str or call.get("type") != "function":
        return False
    function = call.get("function")
    return type(function) is dict and type(function.get("name")) is str and type(function.get("arguments")) is str


CHAT_FIELDS: dict[str, Check] = {
    **COMMON_FIELDS,
    "messages": _messages,
    "logprobs": _boolean,
    "top_logprobs": _integer(0, OPENAI_TOP_LOGPROBS_MAX),
    "tools": _tools,
    "tool_choice": _tool_choice,
    "functions": _array_of(_function_object),
    "function_call": _function_call,
    "parallel_tool_calls": _boolean,
    "response_format": _response_format,
    "reasoning_effort": _one_of("none", "minimal", "low", "medium", "high", "xhigh", "max"),
    "verbosity": _one_of("low", "medium", "high"),
    "modalities": _array_of(_one_of("text", "audio")),
    "store": _boolean,
    "prediction": _object,
    "audio": _object,
    "web_search_options": _object,
}


# --- Completions ---------------------------------------------------------------

def _token_ids(value: list, param: Where) -> bool:
    return all(type(token) is int for token in value)


def _prompt(value: object, param: Where) -> None:
    """A string, strings, token ids, or lists of token ids (each list non-empty)."""
    if type(value) is str:
        return
    if type(value) is not list:
        raise _wrong_type(param, "a string or an array", value)
    if all(type(item) is str for item in value) or (value and _token_ids(value, param)):
        return
    for index, item in enumerate(value):
        if type(item) is not list or not item or not _token_ids(item, param):
            raise InvalidRequest(f"Invalid '{param}': expected a string, an array of strings, an array of token ids or an "
                                 f"array of non-empty arrays of token ids; item {index} is none of these.",
                                 param=param, code="invalid_value")


COMPLETIONS_FIELDS: dict[str, Check] = {
    **COMMON_FIELDS,
    "prompt": _prompt,
    "best_of": _integer(0, OPENAI_BEST_OF_MAX),
    "echo": _boolean,
    "logprobs": _integer(0, OPENAI_COMPLETION_LOGPROBS_MAX),
    "suffix": _string,
}

REQUIRED = {"chat": ("model", "messages"), "completions": ("model", "prompt")}
FIELDS = {"chat": CHAT_FIELDS, "completions": COMPLETIONS_FIELDS}


def check_body(kind: str, body: dict) -> None:
    """Raise InvalidRequest (a 400 with `param`) for the first field OpenAI's document rules out."""
    for name in REQUIRED[kind]:
        if body.get(name) is None:
            raise _missing(name)
    fields = FIELDS[kind]
    for name, value in body.items():
        check = fields.get(name)
        if check is not None and value is not None:
            check(value, name)
