"""Core machinery: operations, the fuser and its autograd bridge, Sequential, the gradient contract."""
