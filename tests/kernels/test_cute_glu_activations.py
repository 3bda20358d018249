"""Every activation the table gives the cute GLU epilogue compiles in both epilogues (FC1 forward
and FC2 dgrad) for sm_90a, without a GPU (a subprocess with CUTE_DSL_ARCH=sm_90a). The GPU
correctness tests (test_cute_glu.py) take their activation list from the same table."""

from __future__ import annotations

import textwrap

import pytest
from cute_marks import compile_for_sm90a, needs_dsl

from te_seq.kernels.activations import epilogue_activations

_SCRIPT = textwrap.dedent(
    """
    import torch
    from te_seq.kernels.cute.compile import GluConfig, compile_glu
    bf16 = torch.bfloat16
    from te_seq.kernels.activations import param_values
    for mode, major in (("fc1", "k"), ("dgrad", "n")):
        cfg = GluConfig(mode, bf16, major, {act!r}, None, torch.float32, params={params!r})
        # the key names the values compiled in (the defaults where none are given)
        assert cfg.params == param_values({act!r}, {params!r}), cfg
        print(cfg, f"{{compile_glu(cfg).compile_s:.1f}}s", flush=True)
    print("ALL COMPILED")
    """
)
_PARAMS = {"clamped_qgelu": (0.9, 1.3, 0.5), "situ": (1.5, 2.0)}


@pytest.mark.slow  # ~10 s of DSL compiles per activation
@needs_dsl
@pytest.mark.parametrize("act", epilogue_activations())
def test_epilogue_activation_compiles_for_sm90a(act: str) -> None:
    params = _PARAMS.get(act, ())  # parameterized entries: non-default compile-time constants
    compile_for_sm90a(_SCRIPT.format(act=act, params=params), timeout=600)
