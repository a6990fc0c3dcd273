"""staticlm.apps.bench."""
