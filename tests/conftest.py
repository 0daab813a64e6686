"""Shared fixtures, and the `slow` mark on every test that loads a real model through them."""

from __future__ import annotations

import pytest
import torch

from delspec.weights.loading import LoadedModel, load_model

# Tiny test models are dominated by per-op overhead, where a second thread only adds contention.
torch.set_num_threads(1)

# Fixtures that load a real model (SmolLM2's GGUF file): the tests that use them are `slow`
# (tests that load one otherwise carry the mark themselves). CI runs them all.
REAL_MODEL_FIXTURES = {"smollm2", "smollm2_float", "smollm2_tensors"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


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
