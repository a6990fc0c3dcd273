"""`staticlm serve`: an OpenAI-compatible HTTP server over one model, with continuous batching (the `serve` extra)."""
