"""Shared fixtures. All tests share one content-hash build cache, so a kernel source compiled by one
test is never compiled again by another (one g++ build of a torch extension takes ~60 s on 2 cores)."""
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# One cache for the whole session (and across sessions on the same machine): builds and baseline timings.
os.environ.setdefault("CUDA_AGENT_CACHE", str(Path(os.environ.get("TMPDIR", "/tmp")) / "cuda-agent-mini-test-cache"))


def has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def pytest_collection_modifyitems(config, items):
    if has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
