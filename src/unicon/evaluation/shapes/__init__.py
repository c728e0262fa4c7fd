"""The embedded world's task accuracies (``unicon evaluate shapes``), in the rooms every suite has
(docs/layout.md)."""
