"""Shared by the cute kernel tests: whether the DSL is installed, whether the cute backend can
run here (and why not), and the pytest marks built from that."""

import importlib.util

import pytest
import torch

HAS_DSL = importlib.util.find_spec("cutlass") is not None


def _cute_ready() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    from te_seq.kernels import cute

    return cute.available()


READY, WHY = _cute_ready()
gpu = pytest.mark.gpu
needs_cute = pytest.mark.skipif(not READY, reason=WHY or "cute backend unavailable")
