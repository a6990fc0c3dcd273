"""staticlm.export.sources."""
