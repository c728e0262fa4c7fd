"""Tiny stand-ins for the real checkpoints the documented commands name, built locally in seconds.

The README and docs/ document commands on real models (``checkpoints/pretrained/Janus-Pro-1B``, an OWLv2
detector, a CLIP model, a Qwen-VL judge). Tests run those exact commands with each path pointing
at a random-weight model of the same family and layout, saved with ``save_pretrained``:
the code path is the real one, only the sizes differ.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]

#: the instruct sets of a test world: a few rows of each kind. The builder's defaults (and its 6,000
#: think-then-draw rows) are sized for the shipped model's world; in a world of a dozen scenes they
#: would take most of its build time and most of its training mixture.
SMALL_INSTRUCT = ("--instruct-mc", "24", "--instruct-geu-per-category", "4", "--instruct-ratings", "24")


def build_world(root: Path, *extra: str, train: int = 12) -> Path:
    """A small ShapesWorld written by the real builder."""
    sys.path.insert(0, str(REPO))
    from data_builders.shapes import main as build_shapes

    build_shapes(["--out", str(root), "--num-train", str(train), "--num-val", "4", "--num-test", "4", "--quiet",
                  "--overwrite", "--num-ureason", "2", "--geneval-per-tag", "2", "--num-drift-seeds", "2",
                  "--num-reason-train", "8", *SMALL_INSTRUCT, *extra])
    return root


def tiny_clip(world: Path, out: Path) -> Path:
    """A randomly initialised tiny open_clip in ``out``, written by the code that trains the ShapesWorld
    CLIP (one step at learning rate 0)."""
    from unicon.embedders.clip import SHAPES_CLIP_CONFIG, train_shapes_clip

    cfg = json.loads(json.dumps(SHAPES_CLIP_CONFIG))
    cfg["embed_dim"] = 16
    cfg["vision_cfg"].update(width=32, layers=1, head_width=16)
    cfg["text_cfg"].update(width=32, heads=2, layers=1)
    train_shapes_clip(world, out, steps=1, lr=0.0, model_cfg=cfg, max_pairs=8, batch_size=8)
    return out


def janus_export(path: Path) -> Path:
    """``configs/model/janus_tiny.yaml`` at random init, saved like a Janus-Pro checkpoint export."""
    from omegaconf import OmegaConf

    from unicon.models.janus import JanusUnifiedModel

    cfg = OmegaConf.to_container(OmegaConf.load(REPO / "configs" / "model" / "janus_tiny.yaml"))
    torch.manual_seed(0)
    JanusUnifiedModel.from_config(cfg).save_pretrained(str(path))
    return path


def owlv2(path: Path) -> Path:
    """A 1-layer OWLv2 with a letter vocabulary (transformers layout)."""
    from transformers import CLIPTokenizer, Owlv2Config, Owlv2ForObjectDetection, Owlv2ImageProcessor, Owlv2Processor

    path.mkdir(parents=True, exist_ok=True)
    vocab = {"!": 0, "<|startoftext|>": 1, "<|endoftext|>": 2}  # OWL masks queries whose first id is 0
    for ch in "abcdefghijklmnopqrstuvwxyz":
        vocab[ch] = len(vocab)
        vocab[ch + "</w>"] = len(vocab)
    (path / "vocab.json").write_text(json.dumps(vocab))
    (path / "merges.txt").write_text("#version: 0.2\n")
    processor = Owlv2Processor(image_processor=Owlv2ImageProcessor(size={"height": 32, "width": 32}),
                               tokenizer=CLIPTokenizer(str(path / "vocab.json"), str(path / "merges.txt")))
    small = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    cfg = Owlv2Config(text_config=dict(vocab_size=len(vocab), max_position_embeddings=16, **small),
                      vision_config=dict(image_size=32, patch_size=8, **small), projection_dim=16)
    torch.manual_seed(0)
    Owlv2ForObjectDetection(cfg).save_pretrained(path)
    processor.save_pretrained(path)
    return path


def qwen2_vl(path: Path) -> Path:
    """A 1-layer Qwen2-VL with a word-level vocabulary, loadable as a ``vlm:`` judge."""
    from transformers import (Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor,
                              Qwen2VLProcessor, Qwen2VLVideoProcessor)

    from test_ureason import CHAT_TEMPLATE, VLM_SPECIALS, _word_tokenizer

    tokenizer, vocab = _word_tokenizer(VLM_SPECIALS)
    tokenizer.image_token = "<|image_pad|>"
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=56 * 56),
        tokenizer=tokenizer, video_processor=Qwen2VLVideoProcessor(), chat_template=CHAT_TEMPLATE)
    cfg = Qwen2VLConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 2, 4]},
                         eos_token_id=vocab["<|im_end|>"], bos_token_id=None, pad_token_id=vocab["<|endoftext|>"]),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2),
        image_token_id=vocab["<|image_pad|>"], video_token_id=vocab["<|video_pad|>"],
        vision_start_token_id=vocab["<|vision_start|>"], vision_end_token_id=vocab["<|vision_end|>"])
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(cfg).save_pretrained(path)
    processor.save_pretrained(path)
    return path


from unicon.models.tiny_parts import LLAVA_CHAT_TEMPLATE, byte_tokenizer as _byte_tokenizer  # noqa: E402,F401


def llava(path: Path, image_size: int = 32) -> Path:
    """The decoupled backend's tiny LLaVA (:func:`unicon.models.tiny_parts.build_tiny_llava`)."""
    from unicon.models.tiny_parts import build_tiny_llava

    return build_tiny_llava(path, image_size)


def stable_diffusion(path: Path, image_size: int = 32) -> Path:
    """The decoupled backend's tiny SD 1.x (:func:`unicon.models.tiny_parts.build_tiny_stable_diffusion`)."""
    from unicon.models.tiny_parts import build_tiny_stable_diffusion

    return build_tiny_stable_diffusion(path, image_size)


def mini_cococon(root: Path, green: int = 120) -> Path:
    """Three CocoCon-schema samples under ``root`` (one without localization; 1 or 2 contrast sets)
    and their 40-px images of colour ``(60 i, green, 30)``: the benchmark's shape, for running the
    CocoCon suite end to end on a backend."""
    from PIL import Image

    (root / "images").mkdir()
    anns, table = [], []
    for i in range(3):
        Image.new("RGB", (40, 30 + i), (60 * i, green, 30)).save(root / "images" / f"{i}.png")
        table.append({"id": i, "file_name": f"images/{i}.png", "width": 40, "height": 30 + i})
        ann = {"id": i, "question_id": 10 + i, "image_id": i, "caption": f"a red circle left of shape {i}",
               "query": "what color is the circle?", "answer": "red",
               "contrast_sets": [{"mutex_caption": f"a {c} circle left of shape {i}", "mutex_answer": c}
                                 for c in ["blue", "green"][: i + 1]]}
        if i != 1:
            ann["detection"], ann["boxes"] = "the circle", [[2, 3, 10, 8]]
            ann["contrast_sets"][0]["mutex_detection"] = "the square"
        anns.append(ann)
    path = root / "cococon.json"
    path.write_text(json.dumps({"annotations": anns, "images": table}))
    return path


# ---------------------------------------------------------------------------------------------
# The one test double of a UnifiedModel: deterministic, configurable, saved and loaded as backend "fake"
# ---------------------------------------------------------------------------------------------
def crc_nll(*parts) -> float:
    """A deterministic pseudo-NLL in [0, 10) of the inputs (crc32: the same in every process, unlike hash())."""
    import zlib

    return (zlib.crc32("|".join(map(str, parts)).encode()) % 10_000) / 1000.0


def pixel_distance(a, b) -> float:
    """Mean absolute difference of two RGB images' pixels (0..255), ``b`` resized to ``a``'s size."""
    x = np.asarray(a.convert("RGB"), dtype=np.float64)
    y = np.asarray(b.convert("RGB").resize(a.size), dtype=np.float64)
    return float(np.abs(x - y).mean())


FAKE_COLORS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255)}


class Killed(Exception):
    """Raised by ``FakeModel(kill_after=n)`` on its n-th model call: stands in for the process being killed."""


def random_scene(cfg, rng, max_objects: int = 3):
    """A random ShapesWorld scene of 1..``max_objects`` objects of world config ``cfg`` in distinct cells."""
    from unicon.worlds import shapes

    cells = rng.choice(cfg.grid ** 2, size=int(rng.integers(1, max_objects + 1)), replace=False)
    return shapes.Scene(tuple(
        shapes.ShapeObject(cfg.shapes[rng.integers(len(cfg.shapes))], cfg.color_names[rng.integers(len(cfg.color_names))],
                           int(k) // cfg.grid, int(k) % cfg.grid) for k in cells))


def scene_for(spec, cfg, rng):
    """A scene that satisfies a ShapesWorld caption spec; relation pairs share a row/column (unambiguous geometry)."""
    from unicon.worlds import shapes, shapes_text

    G = cfg.grid
    for _ in range(500):
        free = {(r, c) for r in range(G) for c in range(G)}
        objs = []

        def put(np_, r, c):
            free.discard((r, c))
            color = np_.color or cfg.color_names[rng.integers(len(cfg.color_names))]
            objs.append(shapes.ShapeObject(np_.shape, color, r, c))

        ok = True
        for cl in spec.clauses:
            if cl.relation is None:
                for _k in range(cl.subject.count):
                    if not free:
                        ok = False
                        break
                    r, c = sorted(free)[rng.integers(len(free))]
                    put(cl.subject, r, c)
            else:
                line = int(rng.integers(G))
                a, b = sorted(rng.choice(G, size=2, replace=False).tolist())
                horizontal = cl.relation in ("left", "right")
                first, second = ((line, a), (line, b)) if horizontal else ((a, line), (b, line))
                if first not in free or second not in free:
                    ok = False
                    break
                subj, obj = (first, second) if cl.relation in ("left", "above") else (second, first)
                put(cl.subject, *subj)
                put(cl.object, *obj)
        if ok:
            scene = shapes.Scene(tuple(objs))
            if shapes_text.spec_matches(spec, scene):
                return scene
    raise AssertionError(f"could not build a scene for {spec.text()!r}")


def _fake_model_class():
    import hashlib
    import re

    import numpy as np
    from PIL import Image

    from unicon.models.base import Scores, TextGeneration, UnifiedModel, pil_to_tensor
    from unicon.models.registry import register_backend

    @register_backend("fake")
    class FakeModel(UnifiedModel):
        """A unified model without learning whose every output is a function of its inputs, so a
        wrong batch, shard, resume or merge shows up downstream. Options (all JSON values, kept by
        ``save_pretrained``; ``model: {backend: fake, arch: {...}}`` builds one):

        * ``scale``: the one parameter (the weights fingerprint); every NLL is ``scale * crc32(inputs)``;
        * ``score_alias``: words replaced in T2I prompts before scoring (``{"tie": "red"}``: ties);
        * ``captions``: caption template over ``{prompt} {hash} {width} {height}`` (``hash``: of the pixels),
          or ``"world"``: the exact description of a ShapesWorld image of ``world`` (else the template's default),
          or ``"world_random"``: the description of a random scene seeded by the pixels (ignores what they show);
        * ``answers``: VQA answers, ``answers[len(question) % len(answers)]``;
        * ``draw``: ``"hash"`` (16x16 pixels from sha256 of the prompt), ``"gray"`` (a grey level from
          crc32 of the prompt), ``"color"`` (solid colour of the last colour word of context + prompt),
          ``"world"`` (a random scene of ``world``, seeded by the prompt), ``"world_exact"`` (a scene of
          ``world`` that the prompt, a ShapesWorld caption, describes; seeded by the prompt), or ``"r,g,b"``
          (one colour);
        * ``world``: a ShapesWorld root, for the ``"world*"`` modes;
        * ``fail_on``: ``generate_image`` raises for a prompt containing this text;
        * ``kill_after``: the n-th model call (any method) raises :class:`Killed`;
        * ``reason``: echoes the prompt's first colour word into a refined prompt, wrapped in commentary.

        ``calls`` records ``(method, batch size)``; ``image_calls`` the prompts and contexts drawn.
        """

        caption_prompt = " what does the image describe?"

        def __init__(self, scale: float = 1.0, score_alias: dict | None = None,
                     captions: str = "{prompt} with pattern {hash}", answers: list | None = None,
                     draw: str = "hash", fail_on: str | None = None, world: str | None = None,
                     kill_after: int | None = None):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.tensor(float(scale)))
            self.options = {"score_alias": dict(score_alias or {}), "captions": captions,
                            "answers": list(answers or ["red"]), "draw": draw, "fail_on": fail_on, "world": world,
                            "kill_after": kill_after}
            self.world_cfg = None
            if world is not None:
                from unicon.worlds.shapes import load_world

                self.world_cfg = load_world(world).config
            self.calls: list[tuple[str, int]] = []
            self.image_calls: list[tuple[list[str], list[str] | None]] = []

        # construction and files
        @classmethod
        def from_config(cls, model_cfg: dict, world_root=None) -> "FakeModel":
            return cls(**dict(model_cfg.get("arch") or {}))

        def save_pretrained(self, path: str) -> None:
            Path(path).mkdir(parents=True, exist_ok=True)
            (Path(path) / "unicon_model.json").write_text(
                json.dumps({"backend": self.backend, "scale": self.scale.item(), **self.options}))

        @classmethod
        def from_pretrained(cls, path: str, **kwargs) -> "FakeModel":
            saved = json.loads((Path(path) / "unicon_model.json").read_text())
            saved.pop("backend")
            return cls(**saved)

        # helpers
        def _call(self, method: str, batch: int) -> None:
            self.calls.append((method, batch))
            if self.options["kill_after"] is not None and len(self.calls) >= self.options["kill_after"]:
                raise Killed(f"{method}: model call {len(self.calls)}")

        def _rng(self, data: bytes):
            return np.random.default_rng(int.from_bytes(hashlib.sha256(data).digest()[:8], "little"))

        @staticmethod
        def _image_key(image) -> tuple:
            return image.getpixel((0, 0)) + image.size

        def _scores(self, rows: list[list[float]]) -> Scores:
            width = max(len(r) for r in rows)
            nll = torch.zeros(len(rows), width)
            mask = torch.zeros(len(rows), width, dtype=torch.bool)
            for b, row in enumerate(rows):
                nll[b, : len(row)] = torch.tensor(row)
                mask[b, : len(row)] = True
            nll = nll * self.scale.detach().float()
            return Scores(nll=nll, sum_nll=nll * 3, mask=mask, num_tokens=mask.long() * 3)

        def prepare_images(self, images):
            return images if isinstance(images, torch.Tensor) else pil_to_tensor([im.resize((8, 8)) for im in images])

        # scoring
        def score_text(self, images, prompts, candidates):
            self._call("score_text", len(images))
            return self._scores([[crc_nll(self._image_key(im), p, c) for c in cands]
                                 for im, p, cands in zip(images, prompts, candidates)])

        def score_boxes(self, images, expressions, boxes):
            self._call("score_boxes", len(images))
            return self._scores([[crc_nll(self._image_key(im), e, box) for e in exprs]
                                 for im, exprs, box in zip(images, expressions, boxes)])

        def score_image(self, prompts, images, contexts=None):
            self._call("score_image", len(images))

            def alias(p: str) -> str:
                for word, other in self.options["score_alias"].items():
                    p = p.replace(word, other)
                return p

            return self._scores([[crc_nll(self._image_key(im), alias(p)) for p in ps] for ps, im in zip(prompts, images)])

        # generation
        def caption(self, images, prompt=None, **kw):
            self._call("caption", len(images))
            if self.options["captions"] == "world":
                return [self._describe(im, prompt) for im in images]
            if self.options["captions"] == "world_random":
                from unicon.worlds import shapes_text

                return [shapes_text.describe_scene(random_scene(self.world_cfg, self._rng(np.asarray(im).tobytes())))
                        for im in images]
            return [self.options["captions"].format(
                prompt=prompt or "image", hash=hashlib.sha256(np.asarray(im).tobytes()).hexdigest()[:10],
                width=im.size[0], height=im.size[1]) for im in images]

        def answer(self, images, questions, **kw):
            self._call("answer", len(questions))
            answers = self.options["answers"]
            return [answers[len(q) % len(answers)] for q in questions]

        def locate(self, images, expressions):
            self._call("locate", len(images))
            return torch.tensor([[0.0, 0.0, im.size[0] / 2, im.size[1] / 2] for im in images])

        def _describe(self, image, prompt) -> str:
            from unicon.worlds import shapes, shapes_text

            try:
                return shapes_text.describe_scene(shapes.parse(image, self.world_cfg))
            except shapes.NotAShapesWorldImage:
                return f"{prompt or 'image'} with pattern {hashlib.sha256(np.asarray(image).tobytes()).hexdigest()[:10]}"

        def _draw_scene(self, prompt: str, exact: bool):
            from unicon.worlds import shapes, shapes_text

            cfg, rng = self.world_cfg, self._rng(prompt.encode())
            scene = scene_for(shapes_text.parse_caption(prompt, cfg), cfg, rng) if exact else random_scene(cfg, rng)
            return shapes.render(scene, cfg, seed=0)

        def _color(self, text: str):
            words = [w for w in re.findall(r"[a-z]+", text.lower()) if w in FAKE_COLORS]
            return words[-1] if words else None

        supports_editing = True

        def edit_image(self, images, instructions, config=None):
            """The identity edit: each image back unchanged (RGB)."""
            if len(images) != len(instructions):
                raise ValueError(f"{len(images)} images and {len(instructions)} instructions")
            self._call("edit_image", len(images))
            return [im.convert("RGB") for im in images]

        def score_edit(self, images, instructions, targets):
            """The identity editor's likelihood: ``[B, 1]`` NLL = the mean absolute pixel difference
            (0..255) between ``targets[b]`` and ``images[b]`` (0 for the unchanged source)."""
            if not len(images) == len(instructions) == len(targets):
                raise ValueError(f"{len(images)} images, {len(instructions)} instructions, {len(targets)} targets")
            self._call("score_edit", len(images))
            return self._scores([[pixel_distance(im, t)] for im, t in zip(images, targets)])

        # embeddings (EditingScore): each row a function of its own input only, never of the batch
        def image_latents(self, images):
            """``[B, 192]``: the 8x8 RGB pixels in [0, 1], times ``scale``."""
            self._call("image_latents", len(images))
            return self.prepare_images(images).flatten(1) * self.scale.detach().float()

        def embed_image(self, images):
            """``[B, 12]``: the 2x2 RGB pixels, centred (in [-0.5, 0.5])."""
            self._call("embed_image", len(images))
            return pil_to_tensor([im.resize((2, 2)) for im in images]).flatten(1) - 0.5

        def embed_text(self, texts):
            """``[B, 12]``: 12 bytes of sha256 of the text, centred (in [-0.5, 0.5])."""
            self._call("embed_text", len(texts))
            return torch.tensor([list(hashlib.sha256(t.encode()).digest()[:12]) for t in texts]) / 255.0 - 0.5

        def generate_image(self, prompts, context=None, config=None):
            self._call("generate_image", len(prompts))
            self.image_calls.append((list(prompts), None if context is None else list(context)))
            draw, out = self.options["draw"], []
            for b, p in enumerate(prompts):
                if self.options["fail_on"] and self.options["fail_on"] in p:
                    raise RuntimeError(f"cannot draw {p!r}")
                if draw == "hash":
                    pixels = np.frombuffer(hashlib.sha256(p.encode()).digest() * 24, dtype=np.uint8)[: 16 * 16 * 3]
                    out.append(Image.fromarray(pixels.reshape(16, 16, 3).copy(), "RGB"))
                elif draw in ("world", "world_exact"):
                    out.append(self._draw_scene(p, exact=draw == "world_exact"))
                elif draw == "gray":
                    out.append(Image.new("RGB", (8, 8), (int(crc_nll(p) * 25),) * 3))
                elif draw == "color":
                    c = self._color((context[b] + " " if context else "") + p)
                    out.append(Image.new("RGB", (8, 8), FAKE_COLORS.get(c, (0, 0, 0))))
                else:
                    out.append(Image.new("RGB", (8, 8), tuple(int(v) for v in draw.split(","))))
            return out

        def reason(self, prompts, max_new_tokens=256):
            self._call("reason", len(prompts))
            out = []
            for p in prompts:
                words = [w for w in re.findall(r"[a-z]+", p.lower()) if w in FAKE_COLORS]
                first = words[0] if words else "grey"
                text = f"<think>The prompt mentions {' and '.join(words)}.</think>\n**Refined prompt:** a {first} square"
                out.append(TextGeneration(text=text, truncated=len(text.split()) > max_new_tokens,
                                          num_tokens=len(text.split())))
            return out

    return FakeModel


#: the configurable UnifiedModel test double (registered as backend "fake")
FakeModel = _fake_model_class()


def fake_backend_plugin(root: Path) -> str:
    """A ``PYTHONPATH`` under which other processes find backend ``fake`` the way an installed plugin
    is found: a distribution's ``entry_points.txt`` declaring ``[unicon.backends] fake = standins``."""
    info = root / "unicon_fake_backend-0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: unicon-fake-backend\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[unicon.backends]\nfake = standins\n")
    return f"{root}:{Path(__file__).resolve().parent}"


def drift_shard_case(tmp_path: Path) -> tuple[Path, str]:
    """``(checkpoint, drift arguments)`` of the sharded-drift tests: a 3-seed world, a FakeModel export
    that captions and draws by the world's rules, and ``tmp_path/.venv`` linked to the project's (the
    sbatch scripts activate the venv of their working directory)."""
    world = build_world(tmp_path / "world", "--num-drift-seeds", "3", "--num-reason-train", "0", train=8)
    ckpt = tmp_path / "ckpt" / "export"
    FakeModel(captions="world", draw="world", world=str(world)).save_pretrained(str(ckpt))
    (tmp_path / ".venv").symlink_to(REPO / ".venv")
    return ckpt, f"--world {world} --generations 2 --embedders scene --batch-size 2 --logger none"


def assert_drift_equals_one_run(merged: Path, ckpt: Path, args: str, env: dict, out: Path) -> None:
    """``merged`` (a merged sharded ``drift.json``) equals one unsharded ``unicon evaluate drift``
    run into ``out``, byte for byte. Each run is its own process and records the checkout's git state,
    which others may commit to meanwhile in a shared tree: those two values are compared for
    presence only (tests/test_sharding.py pins them)."""
    import re
    import subprocess

    proc = subprocess.run([str(REPO / ".venv" / "bin" / "unicon"), "evaluate", "drift", "--ckpt", str(ckpt),
                           "--out", str(out), *args.split()], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]

    def text(path: Path) -> str:
        return re.sub(r'"git\.(commit|dirty)": [^\n,]*', r'"git.\1": _', path.read_text())

    assert text(merged) == text(out / "drift.json")
    assert '"git.commit"' in merged.read_text()


def assert_strict_json(root: Path) -> None:
    """Every ``.json`` and ``.jsonl`` file under ``root`` (one document, or one per line) is strict JSON
    (RFC 8259): parseable by ``json.loads`` with ``NaN``, ``Infinity`` and ``-Infinity`` refused
    (:func:`unicon.jsonsafe.loads_strict`). Fails naming each offending file and line."""
    import re

    from unicon.jsonsafe import loads_strict

    token = re.compile(r'(?<![\w"])-?(NaN|Infinity)(?![\w"])')
    files = sorted(p for p in Path(root).rglob("*") if p.suffix in (".json", ".jsonl") and p.is_file())
    assert files, f"no .json or .jsonl file under {root}"
    problems = []
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        units = list(enumerate(text.splitlines(), 1)) if path.suffix == ".jsonl" else [(1, text)]
        for first_line, unit in units:
            if not unit.strip():
                continue
            try:
                loads_strict(unit)
            except ValueError as e:
                if hasattr(e, "lineno"):  # json.JSONDecodeError knows its line; a refused constant does not
                    at = e.lineno
                else:
                    found = token.search(unit)
                    at = unit.count("\n", 0, found.start()) + 1 if found else 1
                problems.append(f"{path}:{first_line + at - 1}: {e}")
                break
    assert not problems, "not strict JSON:\n" + "\n".join(problems)
