"""Benchmark support for ``delspec bench``: task prompts drawn from datasets shipped in packages."""
