"""UReason (Yang et al.): does a unified model's reasoning reach the pixels? The modules are the rooms
of every suite (docs/layout.md); the instances are loaded by :mod:`unicon.data.ureason`.
"""
