"""Evaluation suites (one module each: cococon, drift, ureason) and their epoch-end callbacks."""
