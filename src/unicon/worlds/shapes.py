"""ShapesWorld: a tiny synthetic world where every caption, answer, box and image is exactly checkable.

A *scene* is a set of 1-4 coloured shapes on a G x G grid (default 4 x 4) of a small RGB canvas
(default 64 x 64 pixels, so one cell is 16 x 16). At most one object lives in a cell and every
shape stays inside its cell, so cells never interact. That makes three things exact:

* :func:`render` -- anti-aliased rendering. Each shape's coverage mask is drawn once at
  ``supersample`` x resolution and box-filtered down (exact area coverage), then pasted into its
  cell, optionally shifted by an integer *jitter* of up to ``jitter`` pixels; optional Gaussian
  pixel *noise* is added last. Given the same ``seed`` the image is bit-identical.
* :func:`parse` -- the symbolic detector. For every cell it reconstructs the pixels of every
  (shape, colour, shift) hypothesis and keeps the best; a cell whose best reconstruction error
  exceeds the tolerance raises :class:`NotAShapesWorldImage` (it never guesses). On noise-free
  renders the reconstruction is exact up to uint8 rounding, so parsing is exact.
* :class:`ShapesTokenizer` -- one code per cell (``0`` = empty, ``1 + shape_idx * len(colors) +
  color_idx`` otherwise). ``encode`` parses, ``decode`` renders canonically (no jitter, no noise),
  so ``encode(decode(codes)) == codes`` always and ``decode(encode(img)) == img`` for canonical
  renders.

Language (captions, questions, referring expressions, contrast sets) lives in
:mod:`unicon.worlds.shapes_text`, the UReason-style reasoning prompts in
:mod:`unicon.worlds.shapes_reasoning`, and the exact GenEval and criterion checkers in
:mod:`unicon.worlds.shapes_verify`; those modules import this one, never the reverse.

Saved models name their image tokenizer ``{"type": "shapes", "world": <WorldConfig dict>}``;
:func:`shapes_image_tokenizer` is registered for that type in :mod:`unicon.core`, which is how
the model layer rebuilds a :class:`ShapesTokenizer` without importing this module. This module
imports only :mod:`unicon.core` of unicon.

Relations are grid relations: ``a`` is *left of* ``b`` iff ``a.col < b.col`` and *above* ``b``
iff ``a.row < b.row`` (rows grow downwards, as in image coordinates).
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np
from PIL import Image, ImageDraw

from unicon.core import ImageTokenizer, register_image_tokenizer

if TYPE_CHECKING:
    import torch

DEFAULT_SHAPES = ("circle", "square", "triangle", "star", "cross", "diamond")
# Palette chosen so that every colour is far from the background and from the others in RGB.
DEFAULT_COLORS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (50, 90, 230),
    "yellow": (240, 220, 50),
    "purple": (150, 60, 200),
    "orange": (245, 140, 30),
    "white": (245, 245, 245),
    "gray": (128, 128, 128),
}
RELATIONS = ("left", "right", "above", "below")


class NotAShapesWorldImage(ValueError):
    """The image was not rendered by this world (wrong size, or a cell matches no shape)."""


# ---------------------------------------------------------------------------------------------
# Configuration and scenes
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WorldConfig:
    """Everything that determines how scenes look. Saved to / loaded from ``world.json``. Immutable."""

    grid: int = 4
    canvas: int = 64
    shapes: tuple[str, ...] = DEFAULT_SHAPES
    colors: dict[str, tuple[int, int, int]] = field(default_factory=lambda: dict(DEFAULT_COLORS))
    background: tuple[int, int, int] = (24, 24, 40)
    min_objects: int = 1
    max_objects: int = 4
    shape_size: float = 0.7  # outer diameter of a shape as a fraction of the cell side
    jitter: int = 1  # max integer shift (pixels) of a shape inside its cell; 0 = centred
    noise: float = 0.0  # std of additive Gaussian pixel noise, in 0..255 units
    supersample: int = 4  # anti-aliasing factor

    def __post_init__(self) -> None:
        object.__setattr__(self, "shapes", tuple(self.shapes))
        object.__setattr__(self, "colors", {str(k): tuple(int(c) for c in v) for k, v in dict(self.colors).items()})
        object.__setattr__(self, "background", tuple(int(c) for c in self.background))
        self.validate()

    # -- derived ---------------------------------------------------------------------------
    @property
    def cell(self) -> int:
        return self.canvas // self.grid

    @property
    def color_names(self) -> tuple[str, ...]:
        return tuple(self.colors)

    @property
    def codebook_size(self) -> int:
        return 1 + len(self.shapes) * len(self.colors)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field when the world cannot be rendered."""
        if self.grid < 1:
            raise ValueError(f"WorldConfig.grid must be >= 1, got {self.grid}")
        if self.canvas % self.grid:
            raise ValueError(f"WorldConfig.canvas ({self.canvas}) must be divisible by grid ({self.grid})")
        if self.cell < 8:
            raise ValueError(f"cells of {self.cell}px are too small to draw shapes (canvas/grid must be >= 8)")
        unknown = sorted(set(self.shapes) - set(_SHAPE_DRAWERS))
        if unknown:
            raise ValueError(f"unknown shapes {unknown}; known: {sorted(_SHAPE_DRAWERS)}")
        if len(self.shapes) < 2 or len(self.colors) < 2:
            raise ValueError("a world needs at least 2 shapes and 2 colours")
        if len(set(self.shapes)) != len(self.shapes):
            raise ValueError(f"duplicate shapes in {self.shapes}")
        for name, rgb in self.colors.items():
            if len(rgb) != 3 or not all(0 <= c <= 255 for c in rgb):
                raise ValueError(f"colour {name!r} must be 3 ints in 0..255, got {rgb}")
            if max(abs(a - b) for a, b in zip(rgb, self.background)) < 60:
                raise ValueError(f"colour {name!r} {rgb} is too close to the background {self.background}")
        if not 1 <= self.min_objects <= self.max_objects:
            raise ValueError(f"need 1 <= min_objects ({self.min_objects}) <= max_objects ({self.max_objects})")
        if self.max_objects > self.grid * self.grid:
            raise ValueError(
                f"max_objects={self.max_objects} objects cannot fit on a {self.grid}x{self.grid} grid "
                f"({self.grid * self.grid} cells, one object per cell)"
            )
        if not 0 < self.shape_size <= 1:
            raise ValueError(f"shape_size must be in (0, 1], got {self.shape_size}")
        if self.jitter < 0 or self.noise < 0 or self.supersample < 1:
            raise ValueError("jitter and noise must be >= 0 and supersample >= 1")
        margin = (self.cell - self.shape_size * self.cell) / 2
        if self.jitter > margin - 0.5:
            raise ValueError(
                f"jitter={self.jitter}px would push shapes out of their {self.cell}px cell "
                f"(shape_size={self.shape_size} leaves {margin:.1f}px margin); lower jitter or shape_size"
            )

    def to_dict(self) -> dict[str, Any]:
        d = {name: getattr(self, name) for name in self.__dataclass_fields__}
        d["shapes"] = list(self.shapes)
        d["colors"] = {k: list(v) for k, v in self.colors.items()}
        d["background"] = list(self.background)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "WorldConfig":
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown WorldConfig keys {unknown}; known: {sorted(known)}")
        return cls(**d)

    @cached_property
    def _key(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def key(self) -> str:
        """A string identifying the config (used to cache the shape masks)."""
        return self._key


@dataclass(frozen=True, order=True)
class ShapeObject:
    """One object: a shape of a colour in grid cell (row, col). Row 0 is the top row."""

    row: int
    col: int
    shape: str
    color: str

    def __init__(self, shape: str, color: str, row: int, col: int) -> None:
        # (shape, color, row, col) is the public argument order; (row, col) orders objects.
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "color", color)
        object.__setattr__(self, "row", int(row))
        object.__setattr__(self, "col", int(col))

    @property
    def kind(self) -> tuple[str, str]:
        return (self.color, self.shape)

    def to_dict(self) -> dict[str, Any]:
        return {"shape": self.shape, "color": self.color, "row": self.row, "col": self.col}


@dataclass(frozen=True)
class Scene:
    """An immutable set of objects, kept sorted by (row, col)."""

    objects: tuple[ShapeObject, ...] = ()

    def __post_init__(self) -> None:
        objs = tuple(sorted(self.objects))
        cells = [(o.row, o.col) for o in objs]
        if len(set(cells)) != len(cells):
            raise ValueError(f"two objects share a cell in {cells}")
        object.__setattr__(self, "objects", objs)

    def __len__(self) -> int:
        return len(self.objects)

    def __iter__(self):
        return iter(self.objects)

    def validate(self, cfg: WorldConfig) -> None:
        for o in self.objects:
            if o.shape not in cfg.shapes:
                raise ValueError(f"unknown shape {o.shape!r}; world shapes: {list(cfg.shapes)}")
            if o.color not in cfg.colors:
                raise ValueError(f"unknown colour {o.color!r}; world colours: {list(cfg.colors)}")
            if not (0 <= o.row < cfg.grid and 0 <= o.col < cfg.grid):
                raise ValueError(f"object {o} is outside the {cfg.grid}x{cfg.grid} grid")

    def count(self, color: str | None = None, shape: str | None = None) -> int:
        return sum(1 for o in self.objects if (color is None or o.color == color) and (shape is None or o.shape == shape))

    def find(self, color: str | None = None, shape: str | None = None) -> list[ShapeObject]:
        return [o for o in self.objects if (color is None or o.color == color) and (shape is None or o.shape == shape)]

    def kinds(self) -> dict[tuple[str, str], int]:
        """Multiset of (color, shape) -> count."""
        out: dict[tuple[str, str], int] = {}
        for o in self.objects:
            out[o.kind] = out.get(o.kind, 0) + 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"objects": [o.to_dict() for o in self.objects]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Scene":
        try:
            return cls(tuple(ShapeObject(o["shape"], o["color"], o["row"], o["col"]) for o in d["objects"]))
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a scene dict (needs objects[].shape/color/row/col): {d!r}") from e

    def key(self) -> tuple:
        return tuple((o.row, o.col, o.shape, o.color) for o in self.objects)


def relation_holds(a: ShapeObject, relation: str, b: ShapeObject) -> bool:
    """Grid relation ``a <relation> b`` for relation in left/right/above/below."""
    if relation == "left":
        return a.col < b.col
    if relation == "right":
        return a.col > b.col
    if relation == "above":
        return a.row < b.row
    if relation == "below":
        return a.row > b.row
    raise ValueError(f"unknown relation {relation!r}; expected one of {RELATIONS}")


def relations_between(a: ShapeObject, b: ShapeObject) -> list[str]:
    return [r for r in RELATIONS if relation_holds(a, r, b)]


# ---------------------------------------------------------------------------------------------
# Shape masks (drawn once per config, cached)
# ---------------------------------------------------------------------------------------------
def _star(cx, cy, r):
    pts = []
    for k in range(10):
        rad = r if k % 2 == 0 else 0.45 * r
        ang = -np.pi / 2 + k * np.pi / 5
        pts.append((cx + rad * np.cos(ang), cy + rad * np.sin(ang)))
    return pts


def _cross(cx, cy, r):
    w = 0.33 * r
    return [(cx - w, cy - r), (cx + w, cy - r), (cx + w, cy - w), (cx + r, cy - w), (cx + r, cy + w),
            (cx + w, cy + w), (cx + w, cy + r), (cx - w, cy + r), (cx - w, cy + w), (cx - r, cy + w),
            (cx - r, cy - w), (cx - w, cy - w)]


_SHAPE_DRAWERS = {
    "circle": lambda d, cx, cy, r: d.ellipse([cx - 0.9 * r, cy - 0.9 * r, cx + 0.9 * r, cy + 0.9 * r], fill=255),
    "square": lambda d, cx, cy, r: d.rectangle([cx - 0.78 * r, cy - 0.78 * r, cx + 0.78 * r, cy + 0.78 * r], fill=255),
    "triangle": lambda d, cx, cy, r: d.polygon([(cx, cy - r), (cx + r, cy + 0.8 * r), (cx - r, cy + 0.8 * r)], fill=255),
    "star": lambda d, cx, cy, r: d.polygon(_star(cx, cy, r), fill=255),
    "cross": lambda d, cx, cy, r: d.polygon(_cross(cx, cy, r), fill=255),
    "diamond": lambda d, cx, cy, r: d.polygon([(cx, cy - r), (cx + 0.8 * r, cy), (cx, cy + r), (cx - 0.8 * r, cy)], fill=255),
}

_CACHE: dict[str, "_Masks"] = {}


@dataclass
class _Masks:
    coverage: np.ndarray  # [S, cell, cell] float in [0, 1], shape centred in its cell
    shifts: list[tuple[int, int]]  # (dy, dx) jitter offsets, index o
    shifted: np.ndarray  # [S, O, cell*cell] coverage of shape s shifted by shifts[o]
    bbox: np.ndarray  # [S, 4] tight [x, y, w, h] of coverage > 0 inside the (unshifted) cell


def _masks(cfg: WorldConfig) -> _Masks:
    key = cfg.key()
    if key not in _CACHE:
        s, ss = cfg.cell, cfg.supersample
        big = s * ss
        covs, boxes = [], []
        for name in cfg.shapes:
            im = Image.new("L", (big, big), 0)
            r = cfg.shape_size * big / 2
            _SHAPE_DRAWERS[name](ImageDraw.Draw(im), big / 2 - 0.5, big / 2 - 0.5, r)
            a = np.asarray(im, dtype=np.float64).reshape(s, ss, s, ss).mean(axis=(1, 3)) / 255.0
            ys, xs = np.nonzero(a > 0)
            if cfg.jitter and min(ys.min(), xs.min(), s - 1 - ys.max(), s - 1 - xs.max()) < cfg.jitter:
                raise ValueError(f"a {cfg.jitter}px jitter would move the {name} out of its cell; lower jitter")
            boxes.append([xs.min(), ys.min(), xs.max() - xs.min() + 1, ys.max() - ys.min() + 1])
            covs.append(a)
        coverage = np.stack(covs)
        j = cfg.jitter
        shifts = [(dy, dx) for dy in range(-j, j + 1) for dx in range(-j, j + 1)]
        shifted = np.stack([np.stack([_shift(c, dy, dx).ravel() for dy, dx in shifts]) for c in coverage])
        _CACHE[key] = _Masks(coverage, shifts, shifted, np.asarray(boxes))
    return _CACHE[key]


def shape_coverage(cfg: WorldConfig) -> np.ndarray:
    """``[len(shapes), cell, cell]`` anti-aliased coverage (0..1) of each shape, centred in a cell."""
    return _masks(cfg).coverage


def _shift(a: np.ndarray, dy: int, dx: int) -> np.ndarray:
    """Shift a mask by whole pixels; the config guarantees the margin is empty, so nothing wraps."""
    return np.roll(np.roll(a, dy, axis=0), dx, axis=1)


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------
def sample_offsets(scene: Scene, cfg: WorldConfig, seed: int | None) -> list[tuple[int, int]]:
    """Per-object (dy, dx) jitter; all zeros when ``seed`` is None or ``cfg.jitter == 0``."""
    if seed is None or cfg.jitter == 0:
        return [(0, 0)] * len(scene)
    rng = np.random.default_rng(seed)
    return [tuple(int(v) for v in rng.integers(-cfg.jitter, cfg.jitter + 1, size=2)) for _ in scene.objects]


def render(scene: Scene, cfg: WorldConfig, seed: int | None = None, noise: float | None = None) -> Image.Image:
    """Render ``scene`` as a ``canvas x canvas`` RGB image.

    ``seed=None`` gives the canonical image (shapes centred, no noise). With a seed, each object
    is shifted by up to ``cfg.jitter`` pixels and Gaussian noise of std ``noise`` (default
    ``cfg.noise``) is added -- deterministically for a given seed.
    """
    scene.validate(cfg)
    m = _masks(cfg)
    s = cfg.cell
    bg = np.asarray(cfg.background, dtype=np.float64)
    img = np.broadcast_to(bg, (cfg.canvas, cfg.canvas, 3)).copy()
    for obj, (dy, dx) in zip(scene.objects, sample_offsets(scene, cfg, seed)):
        a = _shift(m.coverage[cfg.shapes.index(obj.shape)], dy, dx)[..., None]
        color = np.asarray(cfg.colors[obj.color], dtype=np.float64)
        img[obj.row * s:(obj.row + 1) * s, obj.col * s:(obj.col + 1) * s] = bg * (1 - a) + color * a
    sigma = cfg.noise if noise is None else noise
    if seed is not None and sigma > 0:
        img = img + np.random.default_rng([seed, 1]).normal(0.0, sigma, img.shape)
    return Image.fromarray(np.clip(np.round(img), 0, 255).astype(np.uint8), mode="RGB")


def object_box(obj: ShapeObject, cfg: WorldConfig, offset: tuple[int, int] = (0, 0)) -> list[int]:
    """Tight pixel box ``[x, y, w, h]`` of the rendered object (ink coverage > 0)."""
    x, y, w, h = _masks(cfg).bbox[cfg.shapes.index(obj.shape)]
    dy, dx = offset
    return [int(obj.col * cfg.cell + x + dx), int(obj.row * cfg.cell + y + dy), int(w), int(h)]


def scene_boxes(scene: Scene, cfg: WorldConfig, seed: int | None = None) -> list[list[int]]:
    """Boxes of ``scene.objects`` exactly as ``render(scene, cfg, seed)`` draws them."""
    return [object_box(o, cfg, off) for o, off in zip(scene.objects, sample_offsets(scene, cfg, seed))]


# ---------------------------------------------------------------------------------------------
# Parsing (the symbolic detector)
# ---------------------------------------------------------------------------------------------
class ShapeDetection(TypedDict):
    """One detected object, in the dict format the GenEval rules consume."""

    box: list[int]  # [x, y, w, h] pixels
    label: str  # shape name (the GenEval "class")
    color: str
    score: float


def _is_tensor(x) -> bool:
    """Whether ``x`` is a torch tensor, without importing torch (rendering, parsing and building a
    world need none): a tensor exists only once torch is imported."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _as_uint8_array(image, cfg: WorldConfig) -> np.ndarray:
    if _is_tensor(image):
        import torch

        if image.ndim != 3 or image.shape[0] != 3:
            raise NotAShapesWorldImage(f"expected a [3, H, W] tensor, got shape {tuple(image.shape)}")
        arr = (image.detach().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    elif isinstance(image, Image.Image):
        arr = np.asarray(image.convert("RGB"))
    elif isinstance(image, np.ndarray) and image.ndim == 3 and image.shape[2] == 3:
        arr = image
    else:
        raise NotAShapesWorldImage(f"expected a PIL image, [3,H,W] tensor or [H,W,3] array, got {type(image).__name__}")
    if arr.shape[:2] != (cfg.canvas, cfg.canvas):
        raise NotAShapesWorldImage(
            f"image is {arr.shape[1]}x{arr.shape[0]}, but ShapesWorld images are {cfg.canvas}x{cfg.canvas}"
        )
    return arr.astype(np.float64)


def _tolerance(cfg: WorldConfig, tolerance: float | None) -> float:
    """Max RMSE (0..255 units) between a cell and its reconstruction: uint8 rounding + noise."""
    return tolerance if tolerance is not None else 2.0 + 1.5 * cfg.noise


def parse_cells(image, cfg: WorldConfig, tolerance: float | None = None) -> list[tuple[ShapeObject, tuple[int, int]]]:
    """Parse every cell; returns ``(object, (dy, dx) jitter)`` pairs sorted by (row, col).

    Raises :class:`NotAShapesWorldImage` naming the first cell that no hypothesis explains.
    """
    arr = _as_uint8_array(image, cfg)
    tol = _tolerance(cfg, tolerance)
    m = _masks(cfg)
    s = cfg.cell
    bg = np.asarray(cfg.background, dtype=np.float64)
    palette = np.asarray([cfg.colors[c] for c in cfg.color_names], dtype=np.float64)
    names = cfg.color_names
    found = []
    for r in range(cfg.grid):
        for c in range(cfg.grid):
            cell = arr[r * s:(r + 1) * s, c * s:(c + 1) * s].reshape(-1, 3)
            if np.sqrt(((cell - bg) ** 2).mean()) <= tol:
                continue  # empty cell
            # The pixel farthest from the background is fully covered (every shape has an
            # interior), so the nearest palette colour is the first guess; others are fallbacks.
            far = cell[np.argmax(((cell - bg) ** 2).sum(1))]
            order = np.argsort(((palette - far) ** 2).sum(1))
            best = (np.inf, None)
            for ci in order:
                # recon[s, o, p, ch] = bg + coverage * (color - bg)
                recon = bg + m.shifted[..., None] * (palette[ci] - bg)
                err = np.sqrt(((recon - cell) ** 2).mean(axis=(2, 3)))
                si, oi = np.unravel_index(np.argmin(err), err.shape)
                if err[si, oi] < best[0]:
                    best = (err[si, oi], (si, oi, ci))
                if best[0] <= tol:
                    break
            if best[0] > tol:
                raise NotAShapesWorldImage(
                    f"cell (row {r}, col {c}) matches no ShapesWorld shape/colour "
                    f"(best reconstruction RMSE {best[0]:.1f} > tolerance {tol:.1f})"
                )
            si, oi, ci = best[1]
            found.append((ShapeObject(cfg.shapes[si], names[ci], r, c), m.shifts[oi]))
    return found


def parse(image, cfg: WorldConfig, tolerance: float | None = None) -> Scene:
    """Recover the scene of a ShapesWorld image exactly (noise-free renders) or refuse."""
    return Scene(tuple(o for o, _ in parse_cells(image, cfg, tolerance)))


def detect(image, cfg: WorldConfig, tolerance: float | None = None) -> list[ShapeDetection]:
    """Objects with pixel boxes, shape label, colour and ``score=1.0`` (the detector is exact)."""
    return [
        ShapeDetection(box=object_box(o, cfg, off), label=o.shape, color=o.color, score=1.0)
        for o, off in parse_cells(image, cfg, tolerance)
    ]


# ---------------------------------------------------------------------------------------------
# Exact image tokenizer
# ---------------------------------------------------------------------------------------------
def scene_to_codes(scene: Scene, cfg: WorldConfig) -> np.ndarray:
    """``[G, G]`` int64 codes: 0 empty, ``1 + shape_idx * n_colors + color_idx`` otherwise."""
    scene.validate(cfg)
    codes = np.zeros((cfg.grid, cfg.grid), dtype=np.int64)
    nc = len(cfg.colors)
    for o in scene.objects:
        codes[o.row, o.col] = 1 + cfg.shapes.index(o.shape) * nc + cfg.color_names.index(o.color)
    return codes


def codes_to_scene(codes, cfg: WorldConfig) -> Scene:
    codes = np.asarray(codes)
    if codes.shape != (cfg.grid, cfg.grid):
        raise ValueError(f"codes must be [{cfg.grid}, {cfg.grid}], got {list(codes.shape)}")
    if codes.min() < 0 or codes.max() >= cfg.codebook_size:
        raise ValueError(f"codes must be in [0, {cfg.codebook_size}), got range [{codes.min()}, {codes.max()}]")
    nc = len(cfg.colors)
    objs = []
    for r in range(cfg.grid):
        for c in range(cfg.grid):
            k = int(codes[r, c])
            if k:
                objs.append(ShapeObject(cfg.shapes[(k - 1) // nc], cfg.color_names[(k - 1) % nc], r, c))
    return Scene(tuple(objs))


class ShapesTokenizer(ImageTokenizer):
    """Exact ``ImageTokenizer``: one code per grid cell (see module docstring)."""

    def __init__(self, cfg: WorldConfig | None = None) -> None:
        import torch

        self.cfg = cfg or WorldConfig()
        self.codebook_size = self.cfg.codebook_size
        self.grid_size = (self.cfg.grid, self.cfg.grid)
        self.image_size = (self.cfg.canvas, self.cfg.canvas)
        # One canonical cell patch per code; decode is a gather.
        patches = []
        for k in range(self.codebook_size):
            codes = np.zeros(self.grid_size, dtype=np.int64)
            codes[0, 0] = k
            img = np.asarray(render(codes_to_scene(codes, self.cfg), self.cfg))
            patches.append(img[: self.cfg.cell, : self.cfg.cell])
        self._patches = torch.from_numpy(np.stack(patches)).float().div(255.0)  # [K, s, s, 3]

    @classmethod
    def from_world(cls, root: str | Path) -> "ShapesTokenizer":
        return cls(load_world(root).config)

    def encode(self, images) -> torch.Tensor:
        import torch

        if isinstance(images, torch.Tensor):
            if images.ndim != 4:
                raise ValueError(f"expected [B, 3, H, W] images, got shape {tuple(images.shape)}")
            items = list(images)
        else:
            items = list(images)
        if not items:
            return torch.zeros(0, *self.grid_size, dtype=torch.long)
        codes = []
        for i, im in enumerate(items):
            try:
                codes.append(self._codes(_as_uint8_array(im, self.cfg)))
            except NotAShapesWorldImage as e:
                raise NotAShapesWorldImage(f"image {i} of {len(items)}: {e}") from None
        return torch.from_numpy(np.stack(codes))

    #: parsed images remembered by content (training re-encodes the same T2I targets every epoch)
    CACHE_SIZE = 1 << 16

    def _codes(self, arr: np.ndarray) -> np.ndarray:
        """Codes of one image; a parse costs ~1 ms, so results are cached by the pixels' BLAKE2b digest."""
        if not hasattr(self, "_cache"):
            self._cache: OrderedDict[bytes, np.ndarray] = OrderedDict()
        key = hashlib.blake2b(np.ascontiguousarray(arr, dtype=np.uint8).tobytes(), digest_size=16).digest()
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        codes = scene_to_codes(parse(arr, self.cfg), self.cfg)
        self._cache[key] = codes
        if len(self._cache) > self.CACHE_SIZE:
            self._cache.popitem(last=False)
        return codes

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        import torch

        codes = torch.as_tensor(codes, dtype=torch.long)
        if codes.ndim != 3 or tuple(codes.shape[1:]) != self.grid_size:
            raise ValueError(f"codes must be [B, {self.grid_size[0]}, {self.grid_size[1]}], got {tuple(codes.shape)}")
        if codes.numel() and (codes.min() < 0 or codes.max() >= self.codebook_size):
            raise ValueError(f"codes must be in [0, {self.codebook_size}), got [{codes.min()}, {codes.max()}]")
        B, G, s = codes.shape[0], self.cfg.grid, self.cfg.cell
        p = self._patches.to(codes.device)[codes]  # [B, G, G, s, s, 3]
        return p.permute(0, 5, 1, 3, 2, 4).reshape(B, 3, G * s, G * s).contiguous()


# ---------------------------------------------------------------------------------------------
# A built world on disk
# ---------------------------------------------------------------------------------------------
SPLITS = ("train", "val", "test")
UREASON_CATEGORIES = ("arithmetic", "attribute", "spatial", "code")
REALUNIFY_AXES = ("ueg", "geu")


@dataclass
class World:
    """A directory written by ``unicon build-data shapes`` (see the team brief for the layout)."""

    root: Path
    config: WorldConfig
    info: dict[str, Any]

    @property
    def held_out(self) -> list[tuple[str, str]]:
        return [tuple(x) for x in self.info.get("held_out", [])]

    @property
    def tokenizer_path(self) -> Path:
        return self.root / "tokenizer.json"

    def mixture_path(self, split: str) -> Path:
        return self._split_file("mixture_{}.jsonl", split)

    def cococon_path(self, split: str) -> Path:
        return self._split_file("cococon_{}.json", split)

    @property
    def drift_seeds_path(self) -> Path:
        return self.root / "drift_seeds.jsonl"

    @property
    def geneval_path(self) -> Path:
        return self.root / "geneval_metadata.jsonl"

    def edit_path(self, split: str) -> Path:
        """``edit_<split>.jsonl``: the split's image-edit rows (:mod:`unicon.worlds.shapes_edit`)."""
        return self._split_file("edit_{}.jsonl", split)

    def realunify_path(self, axis: str) -> Path:
        """``realunify/<axis>.jsonl`` for ``axis`` in ``ueg`` / ``geu`` (:mod:`unicon.worlds.shapes_realunify`)."""
        if axis not in REALUNIFY_AXES:
            raise ValueError(f"unknown RealUnify axis {axis!r}; expected one of {REALUNIFY_AXES}")
        return self.root / "realunify" / f"{axis}.jsonl"

    def ureason_path(self, category: str, direct: bool = False) -> Path:
        if category not in UREASON_CATEGORIES:
            raise ValueError(f"unknown UReason category {category!r}; expected one of {UREASON_CATEGORIES}")
        return self.root / "ureason" / (f"direct_{category}.jsonl" if direct else f"{category}.jsonl")

    def image(self, rel: str) -> Image.Image:
        return Image.open(self.root / rel).convert("RGB")

    #: the files whose bytes :meth:`fingerprint` hashes: everything a model trained on the world learned from
    FINGERPRINT_FILES = ("world.json", "tokenizer.json", "mixture_train.jsonl", "edit_train.jsonl", "cococon_train.json")

    def fingerprint(self) -> str:
        """``sha256`` over the bytes of :data:`FINGERPRINT_FILES` (each prefixed by its name; absent ones
        skipped): two builds with the same options give the same fingerprint, since every file is a function
        of ``--seed``. A shipped model records the fingerprint of the world it was trained on."""
        digest = hashlib.sha256()
        for name in self.FINGERPRINT_FILES:
            path = self.root / name
            if path.is_file():
                digest.update(name.encode() + b"\0")
                with path.open("rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        digest.update(block)
        return digest.hexdigest()

    def _split_file(self, pattern: str, split: str) -> Path:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
        return self.root / pattern.format(split)


@register_image_tokenizer("shapes")
def shapes_image_tokenizer(spec: dict[str, Any]) -> ShapesTokenizer:
    """A saved model's ``{"type": "shapes", "world": <WorldConfig dict>}``: that world's exact tokenizer."""
    return ShapesTokenizer(WorldConfig.from_dict(spec["world"]))


def load_world(root: str | Path) -> World:
    """Open a built world; a missing or malformed ``world.json`` is a ``FileNotFoundError``/``ValueError``."""
    root = Path(root)
    path = root / "world.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; build the world with `unicon build-data shapes --out {root}`")
    try:
        info = json.loads(path.read_text())
        cfg = WorldConfig.from_dict(info["config"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: not a ShapesWorld world.json ({e})") from e
    return World(root, cfg, info)


__all__ = [
    "WorldConfig", "ShapeObject", "Scene", "ShapeDetection", "NotAShapesWorldImage", "ShapesTokenizer", "World",
    "render", "parse", "parse_cells", "detect", "object_box", "scene_boxes", "scene_to_codes", "codes_to_scene",
    "relation_holds", "relations_between", "load_world", "shape_coverage", "shapes_image_tokenizer", "RELATIONS", "SPLITS", "UREASON_CATEGORIES",
    "REALUNIFY_AXES",
]
