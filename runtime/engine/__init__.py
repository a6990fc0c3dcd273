"""Running a graph family over the KV cache: the Engine (prefill, decode, verify, score), its runners per KV
layout, segmented batches, layer-group parts and KV-Runahead."""
