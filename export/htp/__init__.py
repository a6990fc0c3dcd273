"""staticlm.export.htp."""
