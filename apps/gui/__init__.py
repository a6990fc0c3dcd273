"""staticlm.apps.gui."""
