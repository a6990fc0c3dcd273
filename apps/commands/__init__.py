"""staticlm.apps.commands."""
