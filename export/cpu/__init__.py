"""staticlm.export.cpu."""
