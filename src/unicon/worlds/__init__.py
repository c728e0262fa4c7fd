"""Embedded synthetic worlds where every task has an exactly checkable answer."""
