"""Calibration on recorded decoding traces, shared by both targets: the float family's steps (traces.py) and the
activations a float graph computes on them (activations.py)."""
