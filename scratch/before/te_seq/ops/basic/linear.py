"""Linear: BasicLinear then Bias, as one composite op (state_dict keys `weight`, `bias`)."""

from __future__ import annotations

import torch

from te_seq.core import checks
from te_seq.core.operation import BasicOperation, CompositeOperation
from te_seq.ops.basic.basic_linear import BasicLinear
from te_seq.ops.basic.bias import Bias


class Linear(CompositeOperation):
    """y = x Wᵀ + b, like `torch.nn.Linear`; inside a Sequential it is BasicLinear then Bias
    (so linear+bias fusions apply). Keyword options are BasicLinear's (gradient contract).

    This module owns `weight` and `bias`; its basic ops are handed whatever Parameters its table
    holds each time they run, so weight surgery works as on `torch.nn.Linear`: reassigning
    (`lin.weight = p`, tying `lin2.weight = lin1.weight`), `load_state_dict(..., assign=True)`,
    meta init then `to_empty()`, and `lin.bias = None` (the chain is then BasicLinear alone; a
    Parameter assigned to `bias` later brings Bias back). A weight of another shape than
    [out_features, in_features] (or a bias other than [out_features]) is a ValueError at the
    next forward.

    Tensor parallelism (`tensor_parallel_mode`, `tensor_parallel_group`, `sequence_parallel`,
    as on BasicLinear; sizes are global): "column" shards the bias with the weight's rows
    ([out_features / n] per rank); "row" keeps the whole bias [out_features] on every rank and
    adds it after the reduction (its gradient under `sequence_parallel` is this rank's tokens'
    part, marked `bias.sequence_parallel = True`: sum it over the group, as for norms' weights).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 device=None, dtype: torch.dtype | None = None, **linear_kwargs) -> None:
        super().__init__()
        in_features = checks.positive_int(self, "in_features", in_features)
        out_features = checks.positive_int(self, "out_features", out_features)
        bias = checks.flag(self, "bias", bias)
        checks.param_device(self, device), checks.param_dtype(self, dtype)
        linear = BasicLinear(in_features, out_features, device=device, dtype=dtype, **linear_kwargs)
        self.in_features, self.out_features = in_features, out_features
        self.weight = linear.weight
        bias_op = None
        if bias:
            bias_op = Bias(linear.local_out_features, device=device, dtype=dtype)
            self.bias = bias_op.bias
            if linear.tensor_parallel_mode == "row" and linear.sequence_parallel:
                self.bias.sequence_parallel = True  # a partial gradient per rank
        else:
            self.register_parameter("bias", None)
        # Plain attributes, not submodules: the parameters belong to this module's state_dict.
        object.__setattr__(self, "_linear", linear)
        object.__setattr__(self, "_bias_op", bias_op)

    def basic_ops(self) -> list[BasicOperation]:
        """BasicLinear (then Bias while `bias` is not None), holding this module's Parameters
        as they are now (a Parameter put into the table since the last call is handed over)."""
        linear = self._linear
        weight = self._parameters["weight"]
        if linear._parameters["weight"] is not weight:
            self._check_param("weight", weight,
                              (linear.local_out_features, linear.local_in_features))
            linear.weight = weight
        bias = self._parameters["bias"]
        if bias is None:
            return [linear]
        bias_op = self._bias_op
        if bias_op is None or bias_op._parameters["bias"] is not bias:
            self._check_param("bias", bias, (linear.local_out_features,))
            if bias_op is None:  # built with bias=False, given a bias since
                bias_op = Bias(linear.local_out_features, device="meta", dtype=bias.dtype)
                object.__setattr__(self, "_bias_op", bias_op)
            bias_op.bias = bias
        return [linear, bias_op]

    def _check_param(self, name: str, param: torch.nn.Parameter | None, shape: tuple) -> None:
        if param is None:
            raise ValueError(f"Linear: {name} is None; a Linear needs a weight (only bias may be "
                             "None)")
        if tuple(param.shape) != shape:
            raise ValueError(
                f"Linear: {name} has shape {tuple(param.shape)}, expected {shape} "
                f"(in_features={self.in_features}, out_features={self.out_features})"
            )

    def reset_parameters(self) -> None:
        """W like `torch.nn.Linear` (Kaiming-uniform, a = sqrt(5)), b = 0; in place."""
        for op in self.basic_ops():
            op.reset_parameters()

    def need_backward_dw(self) -> bool:
        return self._linear.need_backward_dw()

    def backward_dw(self) -> None:
        self._linear.backward_dw()

    @property
    def delay_wgrad_compute(self) -> bool:
        return self._linear.delay_wgrad_compute

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}"
