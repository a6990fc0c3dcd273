"""staticlm.runtime.family."""
