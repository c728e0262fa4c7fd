"""The evaluation suites (one package each) and the framework they share (framework.py, suites.py)."""
