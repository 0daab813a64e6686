"""Shared fixtures."""

from __future__ import annotations

import pytest
import torch

from delspec.weights.loading import LoadedModel, load_model

# Tiny test models are dominated by per-op overhead, where a second thread only adds contention.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """The embedded SmolLM2-135M-Instruct on CPU, as users get it (native GGUF blocks).

    Uses the user's delspec cache, so the GGUF conversion happens once, not on every run.
    """
    return load_model("default")


@pytest.fixture(scope="session")
def smollm2_float() -> LoadedModel:
    """The embedded SmolLM2 dequantised to float32: the conversion's numerical reference."""
    return load_model("default", weights="float")
