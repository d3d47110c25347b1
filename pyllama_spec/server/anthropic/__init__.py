"""Anthropic's Messages API, as llama-server serves it: ``POST /v1/messages`` and
``POST /v1/messages/count_tokens``.

``routes`` holds the two routes (whose ``routes(service)`` the app mounts): a request runs as the
chat route's request. ``convert`` turns an Anthropic request into an OpenAI chat body and the chat
answer (or its chunks) back into Anthropic's message object (or its events), and lists where this
server differs from llama-server.
"""
