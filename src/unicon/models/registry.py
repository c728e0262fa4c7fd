"""The backend registry: model-config ``backend:`` names -> :class:`~unicon.models.base.UnifiedModel` classes.

A backend is one class, registered where it is defined::

    @register_backend("ofa")
    class OFAUnifiedModel(UnifiedModel): ...

In-tree backends are registered when ``unicon.models`` is imported (its ``__init__`` imports their
modules). Out-of-tree backends declare their module in the entry-point group
:data:`BACKEND_ENTRY_POINTS` (``[project.entry-points."unicon.backends"] mybackend = "pkg.module"``);
:func:`backend_class` imports it the first time the name is asked for.

A registered class provides the two constructors the factory calls:

* ``from_config(model_cfg: dict, world_root: str | Path | None) -> UnifiedModel`` -- the model a
  ``model:`` section describes (``world_root``: a world whose vocabulary a from-scratch model uses);
* ``from_pretrained(path: str, **kwargs) -> UnifiedModel`` -- a saved directory.

It may import ``unicon.models.base``, ``unicon.errors`` and the standard library.
"""

from __future__ import annotations

import importlib.metadata
from typing import Callable, TypeVar

from unicon.config import BACKEND_ENTRY_POINTS
from unicon.errors import UserError
from unicon.models.base import UnifiedModel

_BACKENDS: dict[str, type[UnifiedModel]] = {}
_MODEL_TYPES: dict[str, str] = {}  # a foreign checkpoint's config.json model_type -> backend name

Backend = TypeVar("Backend", bound=type[UnifiedModel])


def register_backend(name: str, model_types: tuple[str, ...] = ()) -> Callable[[Backend], Backend]:
    """Class decorator: ``model.backend: name`` builds this class. ``model_types``: values of a saved
    directory's ``config.json`` ``model_type`` (besides ``name``) that this backend's
    ``from_pretrained`` reads, or refuses with a message of its own."""

    def register(cls: Backend) -> Backend:
        if not (isinstance(cls, type) and issubclass(cls, UnifiedModel)):
            raise TypeError(f"@register_backend({name!r}) decorates {cls!r}, which is not a UnifiedModel subclass")
        missing = [m for m in ("from_config", "from_pretrained") if not callable(getattr(cls, m, None))]
        if missing:
            raise TypeError(f"backend {name!r} ({cls.__qualname__}) has no {' or '.join(missing)}")
        known = _BACKENDS.get(name)
        if known is not None and known is not cls:
            raise ValueError(f"backend {name!r} is already registered by {known.__module__}.{known.__qualname__}")
        cls.backend = name
        _BACKENDS[name] = cls
        for model_type in (name, *model_types):
            _MODEL_TYPES[model_type] = name
        return cls

    return register


def backend_class(name: str) -> type[UnifiedModel]:
    """The class registered for ``name``; an entry point of that name is loaded first if need be."""
    if name not in _BACKENDS:
        for entry_point in importlib.metadata.entry_points(group=BACKEND_ENTRY_POINTS, name=name):
            entry_point.load()  # its module registers the class
    if name not in _BACKENDS:
        raise UserError(f"model.backend {name!r} is unknown; expected one of {sorted(_BACKENDS)} "
                        f"(or a plugin in the {BACKEND_ENTRY_POINTS!r} entry-point group)")
    return _BACKENDS[name]


def backend_for_model_type(model_type: str | None) -> str | None:
    """The backend that reads checkpoints whose ``config.json`` has this ``model_type`` (None: no backend)."""
    return _MODEL_TYPES.get(model_type) if model_type else None


def registered_backends() -> list[str]:
    return sorted(_BACKENDS)
