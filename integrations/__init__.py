"""Thin layers over AsyncLLMEngine: OpenAI-compatible server, websocket streaming."""
