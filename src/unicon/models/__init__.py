"""Unified model backends behind one interface (base.UnifiedModel)."""
