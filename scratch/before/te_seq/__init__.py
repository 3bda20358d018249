"""te_seq: composable, fusible PyTorch ops for mixture-of-experts and transformer MLPs.

Importing te_seq compiles nothing and does not import the CUTLASS DSL.
"""

from te_seq import ops, recipe
from te_seq.core.fp8 import autocast
from te_seq.fusion import (
    FusionPattern,
    FusionPlan,
    NoMatch,
    PlanMiss,
    PlanStep,
    disable_fusion,
    enable_fusion,
    fusions_disabled,
    list_fusions,
    register_fusion,
)
from te_seq.fusion.registry import unregister_fusion
from te_seq.kernels.backend import backend, current_backend, set_backend
from te_seq.run.sequential import Sequential

__version__ = "0.1.0"


def make_graphed_callables(*args, **kwargs):
    """Capture te_seq modules in CUDA graphs; see te_seq.graphs and docs/cuda_graphs.md.

    te_seq.graphs is imported on the first call, so importing te_seq does not import it.
    """
    from te_seq.graphs import make_graphed_callables as impl

    return impl(*args, **kwargs)


__all__ = [
    "FusionPattern",
    "FusionPlan",
    "NoMatch",
    "PlanMiss",
    "PlanStep",
    "Sequential",
    "autocast",
    "backend",
    "current_backend",
    "disable_fusion",
    "enable_fusion",
    "fusions_disabled",
    "list_fusions",
    "make_graphed_callables",
    "ops",
    "recipe",
    "register_fusion",
    "set_backend",
    "unregister_fusion",
]
