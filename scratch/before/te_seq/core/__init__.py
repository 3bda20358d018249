"""Core machinery: operations, the fuser and its autograd bridge, Sequential, gradient contract."""
