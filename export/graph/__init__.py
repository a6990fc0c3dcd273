"""staticlm.export.graph."""
