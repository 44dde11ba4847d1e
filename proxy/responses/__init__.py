"""The Responses API (`POST /v1/responses`), relayed to workers that serve it
and billed exactly as chat is (DESIGN.md, Metering rules).

- request.py: a caller's body to what a worker gets, and its prompt bound
  (the input read as the chat messages an engine renders it into);
- stream.py: the worker's `response.*` events to what the caller sees, and
  the counts settlement needs;
- store.py: each response's input and output items, per account, so that a
  follow-up naming `previous_response_id` can be sent whole to any worker;
- relay.py: the inference proxy that opens such requests.
"""
