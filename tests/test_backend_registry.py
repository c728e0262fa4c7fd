"""The backend registry: a backend defined in this test module (no edit to ``src/``) is built through the
normal config path (``build_model`` with ``backend: <name>``), saved and loaded back by ``load_model``,
and evaluated by CocoCon; plugins arrive through the ``unicon.backends`` entry points."""

from __future__ import annotations

import importlib.metadata
import json
import zlib
from pathlib import Path

import pytest
import torch
from PIL import Image

import standins

from unicon.core import build_image_tokenizer
from unicon.errors import UserError
from unicon.models import build_model, load_model
from unicon.models.base import Scores, TextGeneration, UnifiedModel, pil_to_tensor
from unicon.models.registry import backend_class, register_backend, registered_backends

BACKEND = "registry-test-fake"


def _text_nll(*parts) -> float:
    """A deterministic pseudo-NLL in [0, 10) of the scored inputs (crc32: the same in every process)."""
    return (zlib.crc32("|".join(map(str, parts)).encode()) % 10_000) / 1000.0


@register_backend(BACKEND)
class FakeBackend(UnifiedModel):
    """A backend with one parameter, ``scale``: every NLL is ``scale * crc32-hash(inputs)``."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(float(scale)))

    @classmethod
    def from_config(cls, model_cfg: dict, world_root=None) -> "FakeBackend":
        return cls(model_cfg["arch"]["scale"])

    @classmethod
    def from_pretrained(cls, path: str, **kwargs) -> "FakeBackend":
        return cls(json.loads((Path(path) / "unicon_model.json").read_text())["scale"])

    def save_pretrained(self, path: str) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "unicon_model.json").write_text(json.dumps({"backend": BACKEND, "scale": self.scale.item()}))

    def prepare_images(self, images):
        return images if isinstance(images, torch.Tensor) else pil_to_tensor([im.resize((8, 8)) for im in images])

    def _scores(self, rows: list[list[float]]) -> Scores:
        width = max(len(r) for r in rows)
        nll = torch.zeros(len(rows), width)
        mask = torch.zeros(len(rows), width, dtype=torch.bool)
        for b, row in enumerate(rows):
            nll[b, : len(row)] = torch.tensor(row)
            mask[b, : len(row)] = True
        nll = nll * self.scale
        return Scores(nll=nll, sum_nll=nll * 2, mask=mask, num_tokens=mask.long() * 2)

    def score_text(self, images, prompts, candidates):
        return self._scores([[_text_nll(im.size, p, c) for c in cands] for im, p, cands in zip(images, prompts, candidates)])

    def score_boxes(self, images, expressions, boxes):
        return self._scores([[_text_nll(im.size, e, box) for e in exprs] for im, exprs, box in zip(images, expressions, boxes)])

    def score_image(self, prompts, images, contexts=None):
        return self._scores([[_text_nll(im.size, p) for p in ps] for ps, im in zip(prompts, images)])

    def caption(self, images, prompt=None, **generate_kwargs):
        return ["a red circle" for _ in images]

    def answer(self, images, questions, **generate_kwargs):
        return ["red" for _ in questions]

    def locate(self, images, expressions):
        return torch.tensor([[0.0, 0.0, im.size[0] / 2, im.size[1] / 2] for im in images])

    def generate_image(self, prompts, context=None, config=None):
        return [Image.new("RGB", (8, 8), (200, 40, 40)) for _ in prompts]

    def reason(self, prompts, max_new_tokens=256):
        return [TextGeneration(text=p) for p in prompts]


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
