"""staticlm: static-shape ONNX graphs and application-owned KV buffers for on-device LLMs."""
