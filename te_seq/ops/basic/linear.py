"""Linear: BasicLinear then Bias, as one composite op (state_dict keys `weight`, `bias`)."""

from __future__ import annotations

import torch

from te_seq.core import checks
from te_seq.core.operation import BasicOperation, CompositeOperation
from te_seq.ops.basic.basic_linear import BasicLinear
from te_seq.ops.basic.bias import Bias


class Linear(CompositeOperation):
    """y = x Wᵀ + b, like `torch.nn.Linear`; inside a Sequential it is BasicLinear then Bias
    (so linear+bias fusions apply). Keyword options are BasicLinear's (gradient contract)."""

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
        ops: list[BasicOperation] = [linear]
        if bias:
            bias_op = Bias(out_features, device=device, dtype=dtype)
            self.bias = bias_op.bias
            ops.append(bias_op)
        else:
            self.register_parameter("bias", None)
        # Plain attribute, not submodules: the parameters belong to this module's state_dict.
        object.__setattr__(self, "_basic_ops", ops)

    def basic_ops(self) -> list[BasicOperation]:
        return list(self._basic_ops)

    def reset_parameters(self) -> None:
        """W like `torch.nn.Linear` (Kaiming-uniform, a = sqrt(5)), b = 0; in place."""
        for op in self._basic_ops:
            op.reset_parameters()

    def _apply(self, fn, recurse: bool = True):
        """Module conversions may put new Parameter objects into this module's table (e.g.
        `to_empty` from the meta device): hand them to the basic ops, which share them."""
        super()._apply(fn, recurse)
        self._basic_ops[0].weight = self.weight
        if self.bias is not None:
            self._basic_ops[1].bias = self.bias
        return self

    def need_backward_dw(self) -> bool:
        return self._basic_ops[0].need_backward_dw()

    def backward_dw(self) -> None:
        self._basic_ops[0].backward_dw()

    @property
    def delay_wgrad_compute(self) -> bool:
        return self._basic_ops[0].delay_wgrad_compute

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}"
