"""The backend registry: a backend defined in this test module (no edit to ``src/``) is built through the
normal config path (``build_model`` with ``backend: <name>``), saved and loaded back by ``load_model``,
and evaluated by CocoCon; plugins arrive through the ``unicon.backends`` entry points."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import standins

from unicon.core import build_image_tokenizer
from unicon.errors import UserError
from unicon.models import build_model, load_model
from unicon.models.registry import backend_class, register_backend, registered_backends

BACKEND = "registry-test-fake"


@register_backend(BACKEND)
class FakeBackend(standins.FakeModel):
    """The project's configurable test double (``standins.FakeModel``: one parameter, ``scale``; every
    NLL is ``scale * crc32(inputs)``), registered under a name of this module: no edit to ``src/``."""


def test_in_tree_backends_are_registered():
    assert {"ofa", "janus", BACKEND} <= set(registered_backends())
    assert FakeBackend.backend == BACKEND


def test_build_save_and_load_through_the_registry(tmp_path):
    model = build_model({"backend": BACKEND, "arch": {"scale": 0.5}, "dtype": "bf16"})
    assert isinstance(model, FakeBackend) and model.scale.dtype == torch.bfloat16  # model options applied
    model.save_pretrained(str(tmp_path / "export"))
    loaded = load_model(tmp_path / "export")
    assert isinstance(loaded, FakeBackend) and loaded.scale.item() == 0.5 and not loaded.training


def test_unknown_backend_names_the_registered_ones():
    with pytest.raises(UserError, match=rf"model.backend 'nope' is unknown; expected one of .*'{BACKEND}'"):
        build_model({"backend": "nope"})


def test_a_second_class_cannot_take_a_registered_name():
    with pytest.raises(ValueError, match="already registered"):
        register_backend(BACKEND)(type("Other", (FakeBackend,), {}))


def test_cococon_runs_on_the_registered_backend(tmp_path):
    from unicon.data.cococon import load_cococon
    from unicon.evaluation.cococon.runner import evaluate_model, normalize_text

    model = build_model({"backend": BACKEND, "arch": {"scale": 1.0}})
    data = load_cococon(standins.mini_cococon(tmp_path, green=90))
    result = evaluate_model(model, data.samples, batch_size=2, cider_tokenizer="simple")
    flat = result.flat()
    for task in ("vqa", "localization", "t2i"):
        assert 0.0 <= flat[f"cococon/{task}/C_1"] <= 100.0
    # the evaluator's caption NLLs are the backend's own scores
    sample = data.samples[2]
    captions = [normalize_text(sample.caption)] + [normalize_text(c.caption) for c in sample.contrast_sets]
    with torch.no_grad():
        direct = model.score_text([sample.load_image()], [model.caption_prompt], [captions]).nll[0].tolist()
    row = next(r for r in result.per_sample if r["id"] == sample.id)
    assert row["nll"]["caption"] == pytest.approx(direct, rel=torch.finfo(torch.float32).eps * 4)


def _plugin_module(tmp_path: Path, monkeypatch, name: str, source: str) -> None:
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))


def _entry_points(group: str, name: str, value: str):
    def entry_points(**selection):
        eps = [importlib.metadata.EntryPoint(name=name, value=value, group=group)]
        return importlib.metadata.EntryPoints(eps).select(**selection)

    return entry_points


def test_an_entry_point_plugin_is_loaded_on_first_use(tmp_path, monkeypatch):
    _plugin_module(tmp_path, monkeypatch, "unicon_plugin_backend", f"""
import sys

from unicon.models.registry import register_backend

FakeBackend = sys.modules[{__name__!r}].FakeBackend

@register_backend("plugin-fake")
class PluginBackend(FakeBackend):
    pass
""")
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        _entry_points("unicon.backends", "plugin-fake", "unicon_plugin_backend"))
    model = build_model({"backend": "plugin-fake", "arch": {"scale": 2.0}})
    assert type(model).__name__ == "PluginBackend" and backend_class("plugin-fake") is type(model)


def test_an_image_tokenizer_plugin_is_loaded_on_first_use(tmp_path, monkeypatch):
    _plugin_module(tmp_path, monkeypatch, "unicon_plugin_tokenizer", """
from unicon.core import register_image_tokenizer
from unicon.worlds.shapes import ShapesTokenizer, WorldConfig

@register_image_tokenizer("plugin-grid")
def build(spec):
    return ShapesTokenizer(WorldConfig(grid=spec["grid"], canvas=16 * spec["grid"]))
""")
    with pytest.raises(UserError, match="image tokenizer type 'plugin-grid' is not registered"):
        build_image_tokenizer({"type": "plugin-grid", "grid": 2})
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        _entry_points("unicon.image_tokenizers", "plugin-grid", "unicon_plugin_tokenizer"))
    assert build_image_tokenizer({"type": "plugin-grid", "grid": 2}).grid_size == (2, 2)


def test_an_installed_plugin_reaches_other_processes(tmp_path):
    """A distribution's ``entry_points.txt`` (what ``pip install`` of a plugin leaves) is all another
    process needs: ``load_model`` there finds backend ``fake`` of ``standins``."""
    standins.FakeModel(scale=0.75).save_pretrained(str(tmp_path / "export"))
    code = ("from unicon.models import load_model; m = load_model(r'%s'); print(type(m).__name__, m.scale.item())"
            % (tmp_path / "export"))
    env = {**os.environ, "PYTHONPATH": standins.fake_backend_plugin(tmp_path / "site")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["FakeModel", "0.75"]
