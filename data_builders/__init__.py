"""Dataset builders run by ``unicon build-data``: ``data_builders.shapes`` (ShapesWorld) and
``data_builders.cococon`` (CocoCon contrast sets from COCO + VQAv2).

A package at the repository root, beside ``src/unicon``; builders import ``unicon``, never the reverse
(only ``unicon.cli`` routes commands to their ``main`` functions).
"""
