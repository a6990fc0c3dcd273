"""staticlm.runtime."""
