"""The OpenAI-compatible HTTP server: the app and `zdsl serve`, the protocol's checks, the engine's slots."""
