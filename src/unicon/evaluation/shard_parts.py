"""The file format of a shard's collective parts (``OUT/shards/shard-<i>-of-<n>/collective-<k>.json``).

A part is what one collective call of a sharded run returns on that rank (per-sample records,
counters, torchmetrics state tensors, strip thumbnails), and the merge reads every shard's parts
back. The file is strict JSON, so reading it runs no code of the file's choosing, whoever wrote it:
``{"format": FORMAT, "version": VERSION, "value": <encoded value>}``.

The encoding round-trips exactly what the suites pass through a collective call:

* ``None``, ``bool``, ``int``, ``str`` and ``list`` as themselves; a finite ``float`` as a JSON number
  (``repr`` round-trips it bit for bit), a non-finite one as ``{"$t": "float", "v": "nan"}``;
* a ``dict`` with ``str`` keys (none of them ``"$t"``) as a JSON object, any other ``dict`` (e.g. the
  ``{sample index: record}`` of ``gather_records``) as ``{"$t": "dict", "v": [[key, value], ...]}``;
* ``tuple``, ``set``, ``frozenset``, ``collections.Counter`` and ``collections.OrderedDict`` tagged
  with their type; ``bytes`` as base64;
* a ``torch.Tensor``, a numpy array or scalar as dtype, shape and the raw bytes (base64);
* a ``PIL.Image.Image`` as mode, size, palette, info and the raw pixel bytes (what pickling an image
  keeps).

:func:`dump_part` raises :class:`TypeError` for any other type (a suite passing a new kind of value
must add it here). :func:`load_part` accepts nothing but this encoding: anything else (a pickle, an
unknown tag, a dtype that is not numeric, bytes that do not fit the shape) is a one-line
:class:`~unicon.errors.UserError` naming the file.
"""

from __future__ import annotations

import base64
import json
import math
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from unicon.errors import UserError

FORMAT = "unicon-shard-part"
VERSION = 1
TAG = "$t"

#: numpy dtype kinds a part may hold: booleans, integers, floats, complex numbers, fixed-width strings
NUMPY_KINDS = "biufcSU"
#: torch dtypes a part may hold, by name
TORCH_DTYPES = {name: getattr(torch, name) for name in (
    "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
    "complex64", "complex128")}
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class _BadPart(ValueError):
    """What is wrong with a part file's content (:func:`load_part` adds the file's name)."""


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------
def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _tensor_bytes(t: torch.Tensor) -> bytes:
    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def _encode(obj: Any) -> Any:
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, (np.generic, np.ndarray)):
        array = np.asarray(obj)
        if array.dtype.kind not in NUMPY_KINDS or array.dtype.fields is not None:
            raise TypeError(f"a shard part cannot hold a numpy value of dtype {array.dtype}")
        tag = "ndarray" if isinstance(obj, np.ndarray) else "npscalar"
        return {TAG: tag, "dtype": array.dtype.str, "shape": list(array.shape),
                "data": _b64(np.ascontiguousarray(array).tobytes())}
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        value = float(obj)
        if math.isfinite(value):
            return value
        return {TAG: "float", "v": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if type(obj) is list:
        return [_encode(v) for v in obj]
    if type(obj) is tuple:
        return {TAG: "tuple", "v": [_encode(v) for v in obj]}
    if type(obj) in (set, frozenset):
        return {TAG: type(obj).__name__, "v": [_encode(v) for v in obj]}
    if type(obj) is dict:
        if all(type(k) is str for k in obj) and TAG not in obj:
            return {k: _encode(v) for k, v in obj.items()}
        return {TAG: "dict", "v": [[_encode(k), _encode(v)] for k, v in obj.items()]}
    if type(obj) in (Counter, OrderedDict):
        return {TAG: type(obj).__name__, "v": [[_encode(k), _encode(v)] for k, v in obj.items()]}
    if type(obj) is bytes:
        return {TAG: "bytes", "v": _b64(obj)}
    if isinstance(obj, torch.Tensor):
        name = str(obj.dtype).removeprefix("torch.")
        if name not in TORCH_DTYPES or obj.layout != torch.strided or obj.is_quantized:
            raise TypeError(f"a shard part cannot hold a {obj.dtype} tensor of layout {obj.layout}")
        return {TAG: "tensor", "dtype": name, "shape": list(obj.shape), "data": _b64(_tensor_bytes(obj))}
    if isinstance(obj, Image.Image):
        info = {}
        for key, value in obj.info.items():  # what can be encoded of the metadata (dpi, gamma, ...)
            try:
                info[key] = _encode(value)
            except TypeError:
                pass
        encoded = {TAG: "image", "mode": obj.mode, "size": list(obj.size), "data": _b64(obj.tobytes()),
                   "info": {TAG: "dict", "v": [[_encode(k), v] for k, v in info.items()]}}
        palette = obj.getpalette() if obj.mode in ("P", "PA", "L", "LA") else None
        if palette:
            encoded["palette"] = palette
        return encoded
    raise TypeError(f"a shard part cannot hold a {type(obj).__module__}.{type(obj).__qualname__}")


def dumps_part(obj: Any) -> str:
    """The text of a part file holding ``obj`` (see the module docstring)."""
    return json.dumps({"format": FORMAT, "version": VERSION, "value": _encode(obj)}, allow_nan=False,
                      separators=(",", ":")) + "\n"


def dump_part(obj: Any, path: str | Path) -> None:
    """Write ``obj`` to the part file ``path``."""
    Path(path).write_text(dumps_part(obj), encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------
def _unb64(text: Any, what: str) -> bytes:
    if not isinstance(text, str):
        raise _BadPart(f"{what}: expected base64 text")
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        raise _BadPart(f"{what}: malformed base64") from None


def _shape(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(d) is int and d >= 0 for d in value):
        raise _BadPart(f"bad shape {str(value)[:60]}")
    return tuple(value)


def _pairs(node: dict) -> list[tuple[Any, Any]]:
    items = node.get("v")
    if not isinstance(items, list) or not all(isinstance(p, list) and len(p) == 2 for p in items):
        raise _BadPart(f"a {node[TAG]} must list [key, value] pairs")
    try:
        return [(_decode(k), _decode(v)) for k, v in items]
    except TypeError:  # an unhashable key
        raise _BadPart(f"a {node[TAG]} key is not hashable") from None


def _items(node: dict) -> list[Any]:
    items = node.get("v")
    if not isinstance(items, list):
        raise _BadPart(f"a {node[TAG]} must list its items")
    return [_decode(v) for v in items]


def _decode_numpy(node: dict) -> Any:
    try:
        dtype = np.dtype(node.get("dtype"))
    except TypeError:
        raise _BadPart(f"unknown numpy dtype {str(node.get('dtype'))[:40]!r}") from None
    if dtype.kind not in NUMPY_KINDS or dtype.fields is not None or dtype.hasobject:
        raise _BadPart(f"numpy dtype {dtype} is not one a part may hold")
    shape = _shape(node.get("shape")) if node[TAG] == "ndarray" else ()
    data = _unb64(node.get("data"), "numpy data")
    if len(data) != math.prod(shape) * dtype.itemsize:
        raise _BadPart(f"numpy data of {len(data)} bytes for shape {list(shape)} of {dtype}")
    array = np.frombuffer(data, dtype=dtype).reshape(shape).copy()
    return array if node[TAG] == "ndarray" else array[()]


def _decode_tensor(node: dict) -> torch.Tensor:
    dtype = TORCH_DTYPES.get(node.get("dtype")) if isinstance(node.get("dtype"), str) else None
    if dtype is None:
        raise _BadPart(f"tensor dtype {str(node.get('dtype'))[:40]!r} is not one a part may hold")
    shape = _shape(node.get("shape"))
    data = _unb64(node.get("data"), "tensor data")
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(data) != math.prod(shape) * itemsize:
        raise _BadPart(f"tensor data of {len(data)} bytes for shape {list(shape)} of {dtype}")
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape).clone()


def _decode_image(node: dict) -> Image.Image:
    mode, size = node.get("mode"), node.get("size")
    if not isinstance(mode, str) or not (isinstance(size, list) and len(size) == 2):
        raise _BadPart("an image needs a mode and a [width, height] size")
    width, height = _shape(size)
    data = _unb64(node.get("data"), "image data")
    if width * height > 8 * len(data):  # not even one bit per pixel: refused before allocating
        raise _BadPart(f"image data of {len(data)} bytes for a {width}x{height} image")
    info = _decode(node.get("info", {}))
    palette = node.get("palette")
    if not isinstance(info, dict) or not (palette is None or (
            isinstance(palette, list) and all(type(v) is int and 0 <= v < 256 for v in palette))):
        raise _BadPart("bad image info or palette")
    try:
        image = Image.new(mode, (width, height))
        if palette:
            image.putpalette(palette)
        image.frombytes(data)
    except (ValueError, TypeError, OSError) as e:
        raise _BadPart(f"unreadable {mode} image ({str(e).splitlines()[0][:80]})") from None
    image.info.update(info)
    return image


def _decode(node: Any) -> Any:
    if isinstance(node, list):
        return [_decode(v) for v in node]
    if not isinstance(node, dict):
        return node  # None, bool, int, float, str
    if TAG not in node:
        return {k: _decode(v) for k, v in node.items()}
    tag = node[TAG]
    if tag == "float":
        if node.get("v") not in _NON_FINITE:
            raise _BadPart(f"a tagged float must be nan, inf or -inf, not {str(node.get('v'))[:20]!r}")
        return _NON_FINITE[node["v"]]
    if tag == "tuple":
        return tuple(_items(node))
    if tag in ("set", "frozenset"):
        try:
            return (set if tag == "set" else frozenset)(_items(node))
        except TypeError:
            raise _BadPart(f"a {tag} item is not hashable") from None
    if tag == "dict":
        return dict(_pairs(node))
    if tag == "Counter":
        return Counter(dict(_pairs(node)))
    if tag == "OrderedDict":
        return OrderedDict(_pairs(node))
    if tag == "bytes":
        return _unb64(node.get("v"), "bytes")
    if tag in ("ndarray", "npscalar"):
        return _decode_numpy(node)
    if tag == "tensor":
        return _decode_tensor(node)
    if tag == "image":
        return _decode_image(node)
    raise _BadPart(f"unknown value type {str(tag)[:40]!r}")


def loads_part(text: str) -> Any:
    """The value of a part file's text; a :class:`ValueError` saying what is wrong otherwise."""

    def refuse(constant: str):
        raise _BadPart(f"non-JSON constant {constant}")

    try:
        doc = json.loads(text, parse_constant=refuse)
    except json.JSONDecodeError as e:
        raise _BadPart(f"not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or "value" not in doc:
        raise _BadPart(f"not a {FORMAT} file (no \"format\": \"{FORMAT}\")")
    if doc.get("version") != VERSION:
        raise _BadPart(f"{FORMAT} version {str(doc.get('version'))[:20]}, this unicon reads version {VERSION}")
    return _decode(doc["value"])


def load_part(path: str | Path) -> Any:
    """The value of the part file ``path``; anything but a part :func:`dump_part` writes is a
    :class:`UserError` naming the file (nothing in it is executed)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UserError(f"merge: cannot read {path} ({e.strerror})") from None
    try:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            pickle_like = raw[:1] == b"\x80"
            raise _BadPart("binary data, a pickle" if pickle_like else "not UTF-8 text") from None
        return loads_part(text)
    except _BadPart as e:
        raise UserError(f"merge: {path} is not a shard part file ({e}); the merge reads only the JSON parts "
                        "that `--shard` writes: rerun that shard") from None
    except RecursionError:
        raise UserError(f"merge: {path} is not a shard part file (nested too deeply); rerun that shard") from None
