"""What a bench run records about the model it ran and the machine it ran on."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys
import time
from importlib import metadata
from typing import Any

import torch

from delspec.kernels.build import cpu_name
from delspec.weights.loading import LoadedModel

MODEL_FIELDS = ("name", "source", "layers", "parameters", "weights", "dtype", "device")
BANDWIDTH_BYTES = 1 << 30  # read by `read_bandwidth`: more than any last-level cache holds


def model_info(lm: LoadedModel) -> dict[str, Any]:
    """The model a run measured: `MODEL_FIELDS` of `LoadedModel.describe`."""
    described = lm.describe()
    return {key: described[key] for key in MODEL_FIELDS}


def run_environment(lm: LoadedModel, command: str | None = None) -> dict[str, Any]:
    """Versions, machine and invocation of this run."""
    device = lm.model.device
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": command or shlex.join(sys.argv),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": metadata.version("transformers"),
        "delspec": metadata.version("delspec"),
        "llama_cpp_python": _version("llama-cpp-python"),
        "llama_cpp_build": llama_cpp_build(),
        "threads": torch.get_num_threads(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "accelerator": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    }


def llama_cpp_build() -> dict[str, str] | None:
    """Which llama.cpp library the llama.cpp peer runs and what its CPU build uses: the one
    `LLAMA_CPP_LIB_PATH` names (e.g. a build for this CPU) or llama-cpp-python's own (CI's
    portable AVX2 build), and llama.cpp's system info line (AVX512 = 1, ...); None where
    llama-cpp-python is not installed or its library does not load."""
    if _version("llama-cpp-python") is None:
        return None
    try:
        import llama_cpp

        info = llama_cpp.llama_print_system_info().decode(errors="replace")
    except Exception:  # an install without a loadable library is no peer
        return None
    return {
        "library": os.environ.get("LLAMA_CPP_LIB_PATH") or "llama-cpp-python's own build",
        "system_info": " ".join(info.split()),
    }


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def read_bandwidth(size: int = BANDWIDTH_BYTES, repeats: int = 5) -> float:
    """Streaming read bandwidth now (GB/s): the fastest of `repeats` sums and as many maxima,
    taking turns, of a float32 tensor of `size` bytes (torch's sum carries a chain of additions
    that can hold it below what the memory delivers; its maximum less so). Other work on the host
    (another VM's included) lowers it, the more so for a size that a quiet host's last-level
    cache would mostly hold."""
    data = torch.ones(max(size // 4, 1))
    data.sum(), data.amax()
    best = float("inf")
    for _ in range(repeats):
        for read in (torch.sum, torch.amax):
            start = time.perf_counter()
            read(data)
            best = min(best, time.perf_counter() - start)
    return data.nbytes / best / 1e9
