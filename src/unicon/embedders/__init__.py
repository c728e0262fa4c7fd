"""Embedding models behind one small interface, used by the drift metrics (MCD)."""
