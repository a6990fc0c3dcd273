"""staticlm.export."""
