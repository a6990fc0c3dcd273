"""Speculative decoding: drafters, the draft-and-verify step for one sequence and for ragged rows, and when it pays."""
