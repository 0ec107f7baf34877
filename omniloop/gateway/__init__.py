"""The OpenAI-compatible gateway: agents written against the OpenAI SDK sample through it,
and every call is recorded as token-exact trajectory segments.

- `openai_wire`: the request model and the messages in omniloop's chat form.
- `recorder`: a session's segments, matched by message prefix.
- `completions`: `Gateway`, completions over an engine, recorded.
- `app`: the HTTP API (`create_gateway_app`).
"""
