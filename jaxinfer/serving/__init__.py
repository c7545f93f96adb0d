"""The OpenAI-compatible HTTP server, its request/response protocol and its metrics."""
