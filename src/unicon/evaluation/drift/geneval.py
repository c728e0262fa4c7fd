"""GenEval for MGG: object-level checks of a generated image against its prompt's metadata.

Rules and aggregation are pure functions; the detectors (:class:`Mask2FormerDetector`,
:class:`Owlv2Detector`, :class:`ShapesDetector`) run models and load weights from disk. Used by the
drift suite only. Two protocols, recorded in ``drift.json`` (``Detector.describe``):

* ``geneval`` (:func:`evaluate_detections`): the rules of GenEval's ``evaluation/evaluate_images.py``
  (Ghosh et al., 2023), below. Mask2Former (COCO instance) with masked colour crops and threshold
  0.3 is the GenEval-comparable detector; ShapesWorld's exact detector serves its world.
* ``telephone-game`` (:func:`evaluate_reference`): the protocol of the Telephone-Game paper's public
  MGG script (``semantic-drift/mgg.py`` of github.com/mollahsabbir/Semantic-Drift-in-Unified-Models),
  used by ``--detector owlv2:<dir>``; see "Telephone-Game protocol" below.

GenEval protocol:

* **Detections kept** per class: score strictly above the detector's threshold (0.9 for ``counting`` prompts), sorted by
  score (highest first), at most 16 per class, no extra NMS (GenEval's defaults).
* **include** ``{class, count}``: the top-``count`` detections of ``class`` must exist.
  **color**: each of those ``count`` boxes is colour-classified, and at least ``count`` must have
  the requested colour. **position** ``[rel, j]``: every one of those boxes must stand in ``rel``
  to every box matched by include clause ``j`` (which must itself have passed).
* **exclude** ``{class, count}``: the image fails if ``count`` or more ``class`` detections were kept.
* **relative position** of A to B with boxes ``[x, y, w, h]``::

      o   = c_A - c_B                                   (box centres, pixels; y grows downwards)
      o'  = sign(o) * max(|o| - 0.1 * (d_A + d_B), 0)   (d = (w, h): a margin per axis)
      (dx, dy) = o' / ||o||                             (normalised by the *raw* offset)
      left of: dx < -0.5,  right of: dx > 0.5,  above: dy < -0.5,  below: dy > 0.5

  and no relation at all when ``|o'| < 1e-3`` on both axes.
* **colour** (zero-shot CLIP): the box crop is classified among the 10 GenEval colours with the
  mean of the normalised text embeddings of three templates, "a photo of a {c} {object}",
  "a photo of a {c}-colored {object}", "a photo of a {c} object".

Telephone-Game protocol (OWLv2, :func:`evaluate_reference`), as the reference script does it:

* **queries**: one per include clause, ``"a photo of a {color} {class}"`` with the clause's
  colour, ``"a photo of a {class}"`` without (:func:`reference_queries`); only the image's own
  clauses are queried, one image at a time. Each OWLv2 box gets the query of its highest score
  and that score; a box of query ``i`` counts for include clause ``i``'s class.
* **threshold** 0.1 (:data:`OWLV2_THRESHOLD`) for every prompt type, counting included: a box is
  kept when its score is > 0.1. No NMS, no cap on the number of boxes, no colour classifier (the
  colour is in the query).
* **include** ``{class, count}``: at least ``count`` kept boxes of ``class`` (all of them are used,
  not the top ``count``). **position** ``[rel, j]``: every kept box of the class must stand in
  ``rel`` to *at least one* box of clause ``j`` (which must have found its boxes); a clause whose
  position fails still serves as a target for later clauses.
* **exclude** ``{class, count}``: fails when ``count`` or more boxes of ``class`` were kept.
* **relative position by pixel offsets** (:func:`pixel_relative_position`)::

      o' = sign(o) * max(|o| - 0.1 * (d_A + d_B), 0)    (as above, in pixels)
      left of: o'_x < -0.5,  right of: o'_x > 0.5,  above: o'_y < -0.5,  below: o'_y > 0.5

  i.e. the margin-reduced offset itself, in pixels, is compared with half a pixel (GenEval
  normalises it by ``||o||`` first).

Where unicon's OWLv2 run still differs from the reference script: (1) the weights are whatever
``owlv2:<dir>`` holds (the reference loads google/owlv2-large-patch14-ensemble; save that one to
compare), recorded as ``source``; (2) boxes are scaled to the padded square of side
``max(W, H)`` that OWLv2 sees, where the reference scales by ``(H, W)``, which distorts boxes of
non-square images (identical for square ones); (3) the reference's loop stops after the first 4
prompts of each generation (``if idx == 4: break``); unicon scores every prompt; (4) the
reference reports the micro average over images; unicon reports it as ``MGG_micro`` next to the
GenEval task mean ``MGG``.

Aggregation: a task's accuracy is the fraction of its images that are correct; the **overall**
score is the unweighted mean of the task accuracies (GenEval's ``summary_scores.py``). The
micro-average over images is reported too as ``overall_micro`` (the Telephone-Game public MGG
script averages over images; we follow the paper's text and GenEval, and keep both).
"""

from __future__ import annotations

import abc
import logging
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from PIL import Image

from unicon.data.geneval import TASKS, GenEvalPrompt
from unicon.errors import UserError
from unicon.worlds.shapes import NotAShapesWorldImage, detect

log = logging.getLogger(__name__)

COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
COLOR_TEMPLATES = (
    "a photo of a {c} {object}", "a photo of a {c}-colored {object}", "a photo of a {c} object",
)
THRESHOLD = 0.3
#: the Telephone-Game reference code's OWLv2 score threshold, for every prompt type (GenEval's 0.3 is for Mask2Former)
OWLV2_THRESHOLD = 0.1
#: the Telephone-Game reference code's OWLv2 query; the class is "{color} {class}" when the clause has a colour
REFERENCE_QUERY = "a photo of a {}"
#: the protocols: GenEval's rules, or the Telephone-Game reference MGG script's (module docstring)
PROTOCOLS = ("geneval", "telephone-game")
#: GenEval's background for masked colour crops (``ImageCrops``: composite over "#999", then crop)
MASK_BACKGROUND = (153, 153, 153)
COUNTING_THRESHOLD = 0.9
MAX_OBJECTS = 16
POSITION_MARGIN = 0.1


@dataclass
class Detection:
    """One detected object: ``box`` is ``[x, y, w, h]`` in pixels."""

    box: tuple[float, float, float, float]
    label: str
    score: float
    color: str | None = None  # known colour (exact detectors); None -> use a colour classifier
    mask: np.ndarray | None = field(default=None, repr=False, compare=False)  # [H, W] bool instance mask

    @classmethod
    def coerce(cls, d: Any, where: str = "detection") -> "Detection":
        if isinstance(d, Detection):
            return d
        if isinstance(d, Mapping):
            get = d.get
        elif all(hasattr(d, k) for k in ("box", "label", "score")):  # e.g. unicon.worlds.shapes.ShapeDetection
            get = lambda k, default=None: getattr(d, k, default)  # noqa: E731
        else:
            raise ValueError(f"{where}: expected a dict with box/label/score, got {type(d).__name__}")
        box, label, score = get("box"), get("label"), get("score")
        if box is None or len(box) != 4:
            raise ValueError(f"{where}: 'box' must be [x, y, w, h], got {box!r}")
        if not isinstance(label, str) or score is None:
            raise ValueError(f"{where}: needs a string 'label' and numeric 'score', got {label!r}, {score!r}")
        return cls(tuple(float(v) for v in box), label, float(score), get("color"))


# ---- rules ----------------------------------------------------------------------------------------------
def keep_detections(
    detections: Sequence[Any], tag: str, threshold: float = THRESHOLD,
    counting_threshold: float = COUNTING_THRESHOLD, max_objects: int | None = MAX_OBJECTS,
) -> dict[str, list[Detection]]:
    """Per class: detections scoring > threshold (0.9 for counting), best first, at most ``max_objects``
    (None: all)."""
    thr = counting_threshold if tag == "counting" else threshold
    by_class: dict[str, list[Detection]] = defaultdict(list)
    for i, d in enumerate(detections):
        d = Detection.coerce(d, f"detection {i}")
        if d.score > thr:
            by_class[d.label].append(d)
    return {k: sorted(v, key=lambda d: -d.score)[:max_objects] for k, v in by_class.items()}


def relative_position(
    box_a: Sequence[float], box_b: Sequence[float], margin: float = POSITION_MARGIN
) -> set[str]:
    """Relations of A to B (``"left of"``, ``"right of"``, ``"above"``, ``"below"``); see module docstring."""
    (xa, ya, wa, ha), (xb, yb, wb, hb) = box_a, box_b
    offset = np.array([xa + wa / 2 - (xb + wb / 2), ya + ha / 2 - (yb + hb / 2)], dtype=np.float64)
    dims = np.array([wa + wb, ha + hb], dtype=np.float64)
    revised = np.maximum(np.abs(offset) - margin * dims, 0.0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    return _relations(*(revised / np.linalg.norm(offset)))


def pixel_relative_position(
    box_a: Sequence[float], box_b: Sequence[float], margin: float = POSITION_MARGIN
) -> set[str]:
    """Relations of A to B by the Telephone-Game reference's rule: the margin-reduced centre offset,
    in pixels and not normalised, compared with +-0.5 (module docstring). Boxes are ``[x, y, w, h]``."""
    (xa, ya, wa, ha), (xb, yb, wb, hb) = box_a, box_b
    dx, dy = xa + wa / 2 - (xb + wb / 2), ya + ha / 2 - (yb + hb / 2)
    rx = max(abs(dx) - margin * (wa + wb), 0.0) * np.sign(dx)
    ry = max(abs(dy) - margin * (ha + hb), 0.0) * np.sign(dy)
    return _relations(rx, ry)


def _relations(dx: float, dy: float) -> set[str]:
    """The relations of an offset ``(dx, dy)`` of A from B: beyond -0.5 or +0.5 on each axis."""
    return {name for name, beyond in (("left of", dx < -0.5), ("right of", dx > 0.5), ("above", dy < -0.5),
                                      ("below", dy > 0.5)) if beyond}


def reference_queries(prompt: GenEvalPrompt, template: str = REFERENCE_QUERY) -> list[str]:
    """The OWLv2 queries of the Telephone-Game protocol: one per include clause, colour included."""
    return [template.format(f"{r.color} {r.cls}" if r.color is not None else r.cls) for r in prompt.include]


def evaluate_reference(
    prompt: GenEvalPrompt, detections: Sequence[Any], threshold: float = OWLV2_THRESHOLD,
) -> "GenEvalResult":
    """The Telephone-Game protocol on one image (module docstring): ``detections`` are labelled
    with the class of the include clause whose query they answered; ``threshold`` applies to every
    prompt type."""
    kept = keep_detections(detections, prompt.tag, threshold, counting_threshold=threshold, max_objects=None)
    correct, reasons = True, []
    matched: list[list[Detection] | None] = []
    for req in prompt.include:
        found = kept.get(req.cls, [])
        if len(found) < req.count:
            correct = False
            reasons.append(f"expected {req.cls}>={req.count} above score {threshold}, found {len(found)}")
            matched.append(None)
            continue
        if req.position is not None:
            rel, j = req.position
            targets = matched[j] if j < len(matched) else None
            if not targets:
                correct = False
                reasons.append(f"no target for {req.cls} to be {rel}")
            elif not all(any(rel in pixel_relative_position(a.box, t.box) for t in targets) for a in found):
                correct = False
                reasons.append(f"expected {req.cls} {rel} target")
        matched.append(found)
    for req in prompt.exclude:
        n = len(kept.get(req.cls, []))
        if n >= req.count:
            correct = False
            reasons.append(f"expected {req.cls}<{req.count}, found {n}")
    return GenEvalResult(correct, reasons)


ColorFn = Callable[[Image.Image | None, Sequence[Detection], str], list[str]]


@dataclass
class GenEvalResult:
    correct: bool
    reasons: list[str]


def evaluate_detections(
    prompt: GenEvalPrompt, detections: Sequence[Any], image: Image.Image | None = None,
    color_classifier: ColorFn | None = None, **keep_kwargs,
) -> GenEvalResult:
    """Apply the GenEval rules of ``prompt`` to one image's raw detections.

    ``color_classifier(image, boxes, classname) -> colours`` is used for ``color`` clauses on boxes
    whose detection carries no colour; the default uses the detection's own ``color``.
    """
    objects = keep_detections(detections, prompt.tag, **keep_kwargs)
    color_fn = color_classifier or detection_colors
    correct, reasons = True, []
    matched: list[list[Detection] | None] = []
    for req in prompt.include:
        found = objects.get(req.cls, [])[: req.count]
        ok = len(found) >= req.count
        if not ok:
            reasons.append(f"expected {req.cls}>={req.count}, found {len(found)}")
        if ok and req.color is not None:
            colors = color_fn(image, found, req.cls)
            if colors.count(req.color) < req.count:
                ok = False
                reasons.append(f"expected {req.count} {req.color} {req.cls}, found colours {colors}")
        if ok and req.position is not None:
            rel, j = req.position
            targets = matched[j]
            if targets is None:
                ok = False
                reasons.append(f"no target for {req.cls} to be {rel}")
            else:
                for obj in found:
                    bad = next((t for t in targets if rel not in relative_position(obj.box, t.box)), None)
                    if bad is not None:
                        ok = False
                        got = relative_position(obj.box, bad.box)
                        found_rel = " and ".join(sorted(got)) or "none"
                        reasons.append(f"expected {req.cls} {rel} target, found {found_rel}")
                        break
        correct &= ok
        matched.append(found if ok else None)
    for req in prompt.exclude:
        n = len(objects.get(req.cls, []))
        if n >= req.count:
            correct = False
            reasons.append(f"expected {req.cls}<{req.count}, found {n}")
    return GenEvalResult(correct, reasons)


def summarize(tags: Sequence[str], correct: Sequence[bool]) -> dict[str, Any]:
    """Per-task accuracy, ``overall`` = mean over the tasks present, ``overall_micro`` = mean over images."""
    if not correct:
        raise ValueError("no images to summarize")
    per: dict[str, list[bool]] = defaultdict(list)
    for t, c in zip(tags, correct, strict=True):
        per[t].append(bool(c))
    order = [t for t in TASKS if t in per] + sorted(t for t in per if t not in TASKS)
    tasks = {t: float(np.mean(per[t])) for t in order}
    return {
        "tasks": tasks,
        "counts": {t: len(per[t]) for t in order},
        "overall": float(np.mean(list(tasks.values()))),
        "overall_micro": float(np.mean([bool(c) for c in correct])),
    }


# ---- colour classifiers ---------------------------------------------------------------------------------
def detection_colors(image: Image.Image | None, boxes: Sequence[Detection], classname: str) -> list[str]:
    """Colours carried by the detections themselves (exact detectors such as ShapesWorld's)."""
    missing = [i for i, b in enumerate(boxes) if b.color is None]
    if missing:
        raise ValueError(
            f"detections of {classname!r} carry no 'color' and no colour classifier was given "
            "(use ClipColorClassifier with an OWLv2-style detector)"
        )
    return [b.color for b in boxes]


def color_crop(image: Image.Image, det: Detection) -> Image.Image:
    """The pixels a colour classifier sees for one detection, as GenEval's ``ImageCrops``: with an
    instance mask, the image composited over a #999 grey background outside the mask, then cut to
    the box; without one, the plain box crop. A crop is at least one pixel (a detector may return a
    degenerate, zero-width box)."""
    image = image.convert("RGB")
    if det.mask is not None:
        mask = np.asarray(det.mask, dtype=bool)
        if mask.shape != (image.height, image.width):
            raise ValueError(f"mask of {det.label!r} is {mask.shape}, the image is {(image.height, image.width)}")
        blank = Image.new("RGB", image.size, MASK_BACKGROUND)
        image = Image.composite(image, blank, Image.fromarray(mask.astype(np.uint8) * 255))
    x, y, w, h = det.box
    return image.crop((round(x), round(y), round(x) + max(1, round(w)), round(y) + max(1, round(h))))


class ClipColorClassifier:
    """Zero-shot colour of a box crop with an open_clip model (GenEval's templates, per class)."""

    def __init__(self, embedder, colors: Sequence[str] = COLORS, templates: Sequence[str] = COLOR_TEMPLATES):
        self.embedder = embedder  # unicon.embedders.clip.ClipEmbedder
        self.colors = list(colors)
        self.templates = list(templates)
        self._heads: dict[str, torch.Tensor] = {}

    def _head(self, classname: str) -> torch.Tensor:
        if classname not in self._heads:
            weights = []
            for c in self.colors:
                emb = self.embedder.embed_text([t.format(c=c, object=classname) for t in self.templates])
                mean = emb.mean(0)
                weights.append(mean / mean.norm())
            self._heads[classname] = torch.stack(weights)  # [C, D]
        return self._heads[classname]

    def __call__(self, image: Image.Image | None, boxes: Sequence[Detection], classname: str) -> list[str]:
        if image is None:
            raise ValueError("ClipColorClassifier needs the image to crop the boxes from")
        crops = [color_crop(image, b) for b in boxes]
        logits = self.embedder.embed_image(crops) @ self._head(classname).T
        return [self.colors[i] for i in logits.argmax(-1).tolist()]


# ---- detectors ------------------------------------------------------------------------------------------
class Detector(abc.ABC):
    """Open-vocabulary detection: ``detect(images, class_names) -> per image, a list of Detection``."""

    #: optional colour classifier for boxes without a colour (None: the detections carry colours)
    color_classifier: ColorFn | None = None
    #: name recorded in drift.json, and the score a detection must exceed to be kept (not counting)
    name: str = "detector"
    threshold: float = THRESHOLD
    source: str | None = None

    #: which rules judge its detections (:data:`PROTOCOLS`)
    protocol: str = "geneval"

    def describe(self) -> dict[str, Any]:
        """What drift.json records: the detector, its weights, protocol, thresholds and colour rule."""
        if self.protocol == "telephone-game":
            return {"name": self.name, "source": self.source, "protocol": self.protocol,
                    "threshold": self.threshold, "counting_threshold": self.threshold,
                    "query": REFERENCE_QUERY.format("[{color} ]{class}"), "color": "in the OWLv2 query",
                    "position": "pixel offsets (Telephone-Game reference)"}
        return {"name": self.name, "source": self.source, "protocol": self.protocol, "threshold": self.threshold,
                "counting_threshold": COUNTING_THRESHOLD,
                "color": "detections' own colours" if self.color_classifier is None else
                ("CLIP on masked crops" if self.masks else "CLIP on box crops"),
                "position": "normalised offsets (GenEval)"}

    #: whether detections carry instance masks (colour crops are then masked, as GenEval's)
    masks: bool = False

    @abc.abstractmethod
    def detect(self, images: Sequence[Image.Image], class_names: Sequence[str]) -> list[list[Detection]]: ...


class Owlv2Detector(Detector):
    """OWLv2 through transformers (``Owlv2ForObjectDetection``).

    ``path`` is a local ``save_pretrained`` directory (model + processor) or a hub id (needs network
    or a filled HF cache). ``protocol="telephone-game"`` (the default, what ``--detector owlv2:<dir>``
    runs) queries each image with its own include clauses (:meth:`detect_prompts`), judged by
    :func:`evaluate_reference`; ``protocol="geneval"`` queries every class name with ``query_template``
    (:meth:`detect`), judged by GenEval's rules (the module docstring says both).
    """

    name = "owlv2"

    def __init__(self, path: str, device: str = "cpu", color_classifier: ColorFn | None = None,
                 query_template: str = REFERENCE_QUERY, threshold: float = OWLV2_THRESHOLD,
                 protocol: str = "telephone-game"):
        from transformers import Owlv2ForObjectDetection, Owlv2Processor

        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol {protocol!r}: use one of {PROTOCOLS}")
        hint = ("give a local directory holding the model and processor (e.g. "
                "google/owlv2-large-patch14-ensemble saved once with save_pretrained)")
        local = Path(path).expanduser()
        if not local.exists() and (str(path).startswith((".", "/", "~")) or str(path).count("/") != 1):
            raise UserError(f"cannot load OWLv2: {local.resolve()} does not exist; {hint}")
        try:
            self.processor = Owlv2Processor.from_pretrained(str(path))
            self.model = Owlv2ForObjectDetection.from_pretrained(str(path)).to(device).eval()
        except OSError as e:
            raise UserError(f"cannot load OWLv2 from {path!r}: {str(e).splitlines()[0]}; {hint}") from None
        self.device = device
        self.protocol = protocol
        self.color_classifier = color_classifier if protocol == "geneval" else None
        self.query_template = query_template
        self.threshold = float(threshold)
        self.source = str(path)

    @torch.no_grad()
    def _detect(self, images: Sequence[Image.Image], queries: Sequence[str],
                labels: Sequence[str]) -> list[list[Detection]]:
        """Every box of every image, labelled ``labels[i]`` for the query ``queries[i]`` it scores best on."""
        images = [im.convert("RGB") for im in images]
        # queries are padded to OWL's text length (it pools each query at its end token) and cut to it
        length = self.model.config.text_config.max_position_embeddings
        inputs = self.processor(text=[list(queries)] * len(images), images=images, return_tensors="pt",
                                padding="max_length", truncation=True, max_length=length)
        inputs = inputs.to(self.device)
        outputs = self.model(**inputs)
        # OWLv2 pads images to a square: boxes are relative to the padded square of side max(W, H)
        sizes = torch.tensor([[max(im.size)] * 2 for im in images])
        results = self.processor.post_process_grounded_object_detection(
            outputs, threshold=0.0, target_sizes=sizes, text_labels=[list(queries)] * len(images)
        )
        out = []
        for res in results:
            dets = []
            rows = zip(res["boxes"].tolist(), res["scores"].tolist(), res["labels"].tolist())
            for box, score, label in rows:
                x0, y0, x1, y1 = box
                dets.append(Detection((x0, y0, x1 - x0, y1 - y0), labels[int(label)], float(score)))
            out.append(dets)
        return out

    def detect(self, images: Sequence[Image.Image], class_names: Sequence[str]) -> list[list[Detection]]:
        """The GenEval protocol's detection: every image queried with ``query_template`` of every class."""
        return self._detect(images, [self.query_template.format(c) for c in class_names], list(class_names))

    def detect_prompts(self, images: Sequence[Image.Image],
                       prompts: Sequence[GenEvalPrompt]) -> list[list[Detection]]:
        """The Telephone-Game protocol's detection: image ``i`` queried with :func:`reference_queries` of
        ``prompts[i]`` alone (one image per forward pass, so no padding query competes), each box
        labelled with the class of the include clause whose query it answered."""
        return [self._detect([im], reference_queries(p, self.query_template), [r.cls for r in p.include])[0]
                for im, p in zip(images, prompts, strict=True)]


class Mask2FormerDetector(Detector):
    """Mask2Former (COCO instance segmentation) through transformers
    (``Mask2FormerForUniversalSegmentation``), the GenEval-comparable detector.

    GenEval runs mmdetection's Mask2Former (Swin-S, COCO instance) and keeps its masks; here the
    same model family comes from a local ``save_pretrained`` directory (model + image processor,
    e.g. facebook/mask2former-swin-small-coco-instance). The instances of
    ``post_process_instance_segmentation`` become detections labelled with ``config.id2label``
    (COCO names, GenEval's class list), boxed by their masks' extent; other labels are dropped.
    Each detection carries its mask, so colour crops are masked as GenEval's (:func:`color_crop`).
    Threshold: GenEval's 0.3 (:data:`THRESHOLD`).
    """

    name = "mask2former"
    masks = True

    def __init__(self, path: str, device: str = "cpu", color_classifier: ColorFn | None = None,
                 threshold: float = THRESHOLD):
        from transformers import AutoImageProcessor, Mask2FormerForUniversalSegmentation

        local = Path(path).expanduser()
        if not local.is_dir():
            raise UserError(f"cannot load Mask2Former: {local.resolve()} is not a local directory (model + "
                            "image processor saved with save_pretrained)")
        try:
            self.processor = AutoImageProcessor.from_pretrained(str(local))
            self.model = Mask2FormerForUniversalSegmentation.from_pretrained(str(local)).to(device).eval()
        except OSError as e:
            raise UserError(f"cannot load Mask2Former from {local}: {str(e).splitlines()[0]}") from None
        self.device = device
        self.color_classifier = color_classifier
        self.threshold = float(threshold)
        self.source = str(path)

    @torch.no_grad()
    def detect(self, images: Sequence[Image.Image], class_names: Sequence[str]) -> list[list[Detection]]:
        images = [im.convert("RGB") for im in images]
        inputs = self.processor(images=images, return_tensors="pt").to(self.device)
        outputs = self.model(**inputs)
        results = self.processor.post_process_instance_segmentation(
            outputs, threshold=0.0, target_sizes=[(im.height, im.width) for im in images])
        wanted = set(class_names)
        out = []
        for res in results:
            seg = res["segmentation"].cpu().numpy()
            dets = []
            for info in res["segments_info"]:
                label = self.model.config.id2label[int(info["label_id"])]
                mask = seg == info["id"]
                if label not in wanted or not mask.any():
                    continue
                ys, xs = np.nonzero(mask)
                box = (float(xs.min()), float(ys.min()), float(xs.max() - xs.min() + 1), float(ys.max() - ys.min() + 1))
                dets.append(Detection(box, label, float(info["score"]), mask=mask))
            out.append(dets)
        return out


class ShapesDetector(Detector):
    """ShapesWorld's exact detector (``unicon.worlds.shapes.detect``): exact boxes, labels and colours."""

    name = "shapes"

    def __init__(self, world_cfg):
        self.world_cfg = world_cfg
        self.source = "ShapesWorld world.json"

    def detect(self, images: Sequence[Image.Image], class_names: Sequence[str]) -> list[list[Detection]]:
        out = []
        for im in images:
            try:
                dets = detect(im, self.world_cfg)
            except NotAShapesWorldImage:
                dets = []  # an image that is not a ShapesWorld rendering contains no object
            out.append([Detection.coerce(d) for d in dets])
        return out


#: model detectors by spec prefix (``<prefix>:<local directory>``)
DETECTORS = {"owlv2": Owlv2Detector, "mask2former": Mask2FormerDetector}


def check_detector_spec(spec: str) -> None:
    """Refuse a detector spec before anything loads: ``shapes``, ``owlv2:<dir>`` or ``mask2former:<dir>``."""
    if spec == "shapes":
        return
    if spec.split(":", 1)[0] not in DETECTORS or ":" not in spec:
        raise UserError(f"--detector {spec!r}: use 'shapes', 'owlv2:<local model directory>' (the Telephone-Game "
                        "reference protocol: colour in the query, threshold 0.1 for every prompt type) or "
                        "'mask2former:<local model directory>' (GenEval's rules, 0.3)")
    path = Path(spec.split(":", 1)[1]).expanduser()
    if not path.is_dir():
        raise UserError(f"--detector {spec}: {path} is not a local model directory (detectors load from disk only)")


def load_detector(spec: str, world_cfg=None, color_classifier: ColorFn | None = None,
                  threshold: float | None = None) -> Detector:
    """``"shapes"`` (needs ``world_cfg``), ``"owlv2:<local directory>"`` or ``"mask2former:<local directory>"``;
    ``threshold`` None keeps the detector's reference value (OWLv2 0.1, Mask2Former 0.3); the exact
    ``shapes`` detector has no score to threshold, so a threshold for it is refused."""
    if spec == "shapes":
        if threshold is not None:
            raise UserError(f"--detector-threshold {threshold}: the 'shapes' detector is exact (every detection "
                            "scores 1) and has no threshold; the threshold is for --detector owlv2:<dir> or "
                            "mask2former:<dir>")
        if world_cfg is None:
            raise UserError("the 'shapes' detector needs the ShapesWorld config (give --world DIR)")
        return ShapesDetector(world_cfg)
    check_detector_spec(spec)
    kind, path = spec.split(":", 1)
    extra = {} if threshold is None else {"threshold": threshold}
    return DETECTORS[kind](path, color_classifier=color_classifier, **extra)


def score_images(
    prompts: Sequence[GenEvalPrompt], images: Sequence[Image.Image], detector: Detector,
    class_names: Sequence[str] | None = None, batch_size: int = 16,
) -> tuple[dict[str, Any], list[GenEvalResult]]:
    """GenEval summary of ``images[i]`` generated for ``prompts[i]`` (see :func:`summarize`)."""
    if len(prompts) != len(images):
        raise ValueError(f"{len(prompts)} prompts but {len(images)} images")
    if class_names is None:
        class_names = sorted({r.cls for p in prompts for r in (*p.include, *p.exclude)})
    results = []
    reference = getattr(detector, "protocol", "geneval") == "telephone-game"
    for s in range(0, len(images), batch_size):
        batch, batch_prompts = images[s : s + batch_size], prompts[s : s + batch_size]
        if reference:
            for p, d in zip(batch_prompts, detector.detect_prompts(batch, batch_prompts)):
                results.append(evaluate_reference(p, d, threshold=detector.threshold))
            continue
        dets = detector.detect(batch, class_names)
        for p, im, d in zip(batch_prompts, batch, dets):
            results.append(evaluate_detections(p, d, image=im, color_classifier=detector.color_classifier,
                                               threshold=detector.threshold))
    return summarize([p.tag for p in prompts], [r.correct for r in results]), results
