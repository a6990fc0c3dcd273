"""staticlm.apps."""
