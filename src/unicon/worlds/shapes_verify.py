"""Exact ShapesWorld verifiers: the GenEval rules on detector output, and the reasoning criterion.

:func:`check_geneval` follows GenEval's ``evaluate_image`` rules on a metadata row:

* every ``include`` item ``{class, count[, color][, position]}`` needs at least ``count``
  detections of ``class``; with ``color``, ``count`` of them must have that colour; with
  ``position = [relation, group]``, each found object must stand in ``relation`` to every object
  matched by include item ``group``;
* every ``exclude`` item ``{class, count}`` fails the image when ``count`` or more detections of
  ``class`` exist.

Two deliberate differences from GenEval, because the ShapesWorld detector is exact:

1. GenEval keeps the ``count`` most confident detections and then checks their colour (with a
   CLIP colour classifier). All our scores are 1.0, so "most confident" is undefined; we keep the
   ``count`` detections that best satisfy the colour, i.e. the item passes iff at least ``count``
   objects of that class *and colour* exist.
2. GenEval decides "left of"/"above" from the direction of the offset between box centres with a
   dead zone of 0.1 x (sum of box sizes). ShapesWorld uses grid relations (``left of`` iff the
   column index is smaller, ``above`` iff the row index is smaller), which is what its captions mean;
   the cell of a detection is the cell holding its box centre.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from unicon.worlds.shapes import (
    NotAShapesWorldImage,
    ShapeObject,
    WorldConfig,
    parse,
    relation_holds,
)
from unicon.worlds.shapes_text import pattern_matches

_GENEVAL_RELATIONS = {"left of": "left", "right of": "right", "above": "above", "below": "below"}


def _field(det: Any, key: str):
    return det[key] if isinstance(det, Mapping) else getattr(det, key)


def _cell_object(det: Any, cfg: WorldConfig) -> ShapeObject:
    x, y, w, h = _field(det, "box")
    col = min(cfg.grid - 1, max(0, int((x + w / 2) // cfg.cell)))
    row = min(cfg.grid - 1, max(0, int((y + h / 2) // cfg.cell)))
    return ShapeObject(_field(det, "label"), _field(det, "color"), row, col)


def check_geneval(row: Mapping[str, Any], detections: Sequence[Any], cfg: WorldConfig | None = None) -> bool:
    """True iff ``detections`` (dicts or objects with box/label/color) satisfy GenEval ``row``."""
    cfg = cfg or WorldConfig()
    if "include" not in row:
        raise ValueError(f"GenEval row without 'include': {dict(row)!r}")
    objs = [_cell_object(d, cfg) for d in detections]
    matched_groups: list[list[ShapeObject] | None] = []
    correct = True
    for req in row["include"]:
        cls, count = req["class"], int(req["count"])
        candidates = [o for o in objs if o.shape == cls]
        if "color" in req:  # difference 1: prefer objects of the requested colour
            candidates.sort(key=lambda o: o.color != req["color"])
        found = candidates[:count]
        matched = len(found) >= count
        if matched and "color" in req:
            matched = sum(o.color == req["color"] for o in found) >= count
        if matched and "position" in req:
            relation, group = req["position"]
            if relation not in _GENEVAL_RELATIONS:
                raise ValueError(f"unknown GenEval relation {relation!r} in {dict(row)!r}")
            targets = matched_groups[int(group)] if int(group) < len(matched_groups) else None
            matched = targets is not None and all(
                relation_holds(o, _GENEVAL_RELATIONS[relation], t) for o in found for t in targets
            )
        matched_groups.append(found if matched else None)
        correct = correct and matched
    for req in row.get("exclude", []):
        if sum(o.shape == req["class"] for o in objs) >= int(req["count"]):
            correct = False
    return correct


def check_criterion(target_scene: Mapping[str, Any], image, cfg: WorldConfig | None = None) -> bool:
    """Does ``image`` satisfy a reasoning prompt's target pattern exactly?

    ``target_scene`` is ``{"objects": [{"shape", "color"[, "row", "col"]}], "relations":
    [{"subject": i, "relation": "left", "object": j}]}`` (see ``pattern_matches``). An image the
    parser refuses (not a ShapesWorld image) fails the criterion.
    """
    cfg = cfg or WorldConfig()
    try:
        scene = parse(image, cfg)
    except NotAShapesWorldImage:
        return False
    return pattern_matches(dict(target_scene), scene)
