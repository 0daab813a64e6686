"""Weights: GGUF files read in place, safetensors tensor by tensor, weight formats, named
models shipped in packages, and loading a model from any of them."""
