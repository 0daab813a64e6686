"""Wall-clock timing that is correct on asynchronous devices."""

from __future__ import annotations

import torch


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so that a clock read after it covers that work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
