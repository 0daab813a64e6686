"""Decoding: the engine (one round: draft, verify, accept, commit), sequences, prefill,
sampling and generate()."""
