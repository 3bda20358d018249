"""The runtime: `Sequential` and the `Fuser` that executes a fusion plan (above `fusion/`)."""
