"""The evaluation suites (one package each) and the framework they share (framework.py, suites.py).

Every suite's figures are drawn on bare :class:`matplotlib.figure.Figure` objects and saved directly:
no pyplot state, and the caller's matplotlib backend is left alone.
"""
