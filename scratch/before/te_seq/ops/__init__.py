"""te_seq.ops: the basic ops users chain in a Sequential, the base classes, and fused ops."""

from te_seq.core.context import OperationContext
from te_seq.core.operation import (
    BasicOperation,
    CompositeOperation,
    FusedOperation,
    FusibleOperation,
)
from te_seq.ops import fused
from te_seq.ops.basic import *  # noqa: F403
from te_seq.ops.basic import __all__ as _basic_all

__all__ = [
    "BasicOperation",
    "CompositeOperation",
    "FusedOperation",
    "FusibleOperation",
    "OperationContext",
    "fused",
    *_basic_all,
]
