"""Training objectives: the cross-task rank-consistency losses of CocoCon (Algorithm 1)."""
