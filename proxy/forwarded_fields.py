"""The request fields a worker gets: the one list (DESIGN.md, Metering rules).

Only fields that OpenAI's API (CreateChatCompletionRequest,
CreateCompletionRequest) or vLLM's OpenAI-compatible server document, and
that cannot move what the proxy bills without the proxy counting it, are
forwarded. Everything else is dropped silently, as vLLM ignores fields it does
not know, so that nothing a caller sends can make a worker misbehave or an
honest worker look dishonest.

Two things a field must not do:
- change the prompt beyond what `metering.prompt_tokens_bound` counts (the
  template, its arguments, documents, an echo, a suffix);
- make the engine produce tokens that are never relayed, so that an honest
  report would exceed the bound of what was relayed (`ignore_eos` keeps
  generating past end-of-sequence tokens that are stripped from the text;
  `logit_bias` and `allowed_token_ids` can force special tokens that
  detokenise to nothing; `best_of` and `use_beam_search` generate sequences
  nobody receives; `prompt_logprobs` scores the prompt).

`n` > 1 is forwarded: every one of its choices is relayed and counted on its
own (proxy/generation.py), and the hold pays for each.

The proxy sets `model`, `stream`, `stream_options` and `max_tokens` itself.
"""
from __future__ import annotations

from proxy import metering

# Counted by the prompt bound.
PROMPT_FIELDS = frozenset({
    "messages",  # chat: every message shape is counted, image/audio/file parts are refused
    "prompt",  # completions: a string or a list of token ids, or a list of either (each counted)
    "tools", "functions",  # counted as their JSON with the tools preamble
    "tool_choice", "function_call",  # counted as their JSON; a named choice only constrains decoding
    "response_format",  # counted as its JSON schema (vLLM uses it for decoding, not in the prompt)
    "reasoning_effort",  # a template may put it in the system turn: counted as its bytes
})

# Shape what is sampled, never the prompt, and every token they let through is relayed.
SAMPLING_FIELDS = frozenset({
    # OpenAI
    "temperature", "top_p", "frequency_penalty", "presence_penalty", "seed", "stop",
    "logprobs", "top_logprobs", "parallel_tool_calls",  # logprobs repeat relayed tokens, never billed
    "n",  # validated (metering.requested_choices), held for, each choice relayed and counted
    # vLLM sampling parameters
    "top_k", "min_p", "repetition_penalty", "min_tokens",  # min_tokens only holds back the stop tokens
    "stop_token_ids", "include_stop_str_in_output", "bad_words",
    "skip_special_tokens", "spaces_between_special_tokens",  # special tokens shown are relayed, so counted
    "truncate_prompt_tokens",  # can only shorten the prompt
    # vLLM structured outputs (the output still arrives as relayed text)
    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_decoding_backend", "guided_whitespace_pattern",
})

FORWARDED_FIELDS = PROMPT_FIELDS | SAMPLING_FIELDS


def upstream_fields(body: dict) -> dict:
    """The caller's body without the fields a worker must not see, its
    messages holding only what the prompt bound counts. Built once per request."""
    forwarded = {name: value for name, value in body.items() if name in FORWARDED_FIELDS}
    if isinstance(forwarded.get("messages"), list):
        forwarded["messages"] = [kept for kept in map(_message, forwarded["messages"]) if kept is not None]
    return forwarded


# Inside `messages` too, a worker gets only what the prompt bound counted:
# chat templates render keys they are given (a `thinking` key, say), which
# would put uncounted tokens in an honest worker's prompt report. A chat
# body's shape was validated by metering.prompt_tokens_bound before it is
# built; what is not of that shape (messages sent to /v1/completions) is dropped.

def _message(message: object) -> dict | None:
    if not isinstance(message, dict):
        return None
    kept = {key: message[key] for key in ("role",) + metering.MESSAGE_STRING_KEYS if isinstance(message.get(key), str)}
    content = message.get("content")
    if "content" in message and (content is None or isinstance(content, str)):
        kept["content"] = content
    elif isinstance(content, list):
        kept["content"] = [part for part in map(_content_part, content) if part is not None]
    if isinstance(message.get("tool_calls"), list):
        kept["tool_calls"] = [call for call in map(_tool_call, message["tool_calls"]) if call is not None]
    if isinstance(message.get("function_call"), dict):
        kept["function_call"] = _function(message["function_call"])
    return kept


def _content_part(part: object) -> dict | None:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in metering.TEXT_PART_TYPES:
        return None
    key = metering.content_part_text_key(kind)
    return {"type": kind, key: part.get(key)}


def _tool_call(call: object) -> dict | None:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return None
    kept = {key: call[key] for key in metering.TOOL_CALL_STRING_KEYS if isinstance(call.get(key), str)}
    kept["function"] = _function(call["function"])
    return kept


def _function(function: dict) -> dict:
    kept = {key: function[key] for key in metering.FUNCTION_KEYS if key in function}
    if not isinstance(kept.get("name", ""), str):
        del kept["name"]  # counted as its bytes only when it is a string
    return kept
