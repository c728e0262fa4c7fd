"""Scripted annotators: answer a study over its HTTP API from the exact ShapesWorld verifier.

The rubric (:func:`rate_caption`, :func:`rate_image`), from :func:`unicon.worlds.shapes_text.caption_mismatch`:

* **good**: the caption describes the input scene exactly (understanding), or the image parses back to
  a scene the prompt describes exactly (generation);
* **medium**: the right objects with a wrong relation, or too few / too many objects;
* **poor**: wrong colours or shapes, an unparsable caption, or an image that is not a ShapesWorld image.

The ranking orders the outputs by rating (good first); ties are broken by the sha256 of the output
(caption text or PNG bytes), which does not depend on the masked order, so two noiseless annotators
agree exactly and the study's results are known in advance (:func:`judge` applied to the inputs).
``noise`` is the probability that a rating moves to another level and that two adjacent outputs of a
ranking with the same rating swap; the ranking is made from the (noisy) ratings, so it never
contradicts them (the app refuses such a judgement: :mod:`unicon.study.ranking`).
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import urllib.error
import urllib.request
from typing import Mapping

from PIL import Image

from unicon.study.db import LEVEL_VALUE, LEVELS
from unicon.worlds.shapes import NotAShapesWorldImage, Scene, WorldConfig, parse
from unicon.worlds.shapes_text import caption_mismatch

MEDIUM = ("relation", "fewer_objects", "more_objects")


def rate_caption(caption: str, scene: Scene, cfg: WorldConfig) -> str:
    why = caption_mismatch(caption, scene, cfg)
    return "good" if why is None else "medium" if why in MEDIUM else "poor"


def scene_of(png: bytes, cfg: WorldConfig) -> Scene | None:
    """The scene of a ShapesWorld image, None when it is not one."""
    try:
        with Image.open(io.BytesIO(png)) as im:
            return parse(im.convert("RGB"), cfg)
    except (NotAShapesWorldImage, OSError):
        return None


def rate_image(png: bytes, prompt: str, cfg: WorldConfig) -> str:
    scene = scene_of(png, cfg)
    return "poor" if scene is None else rate_caption(prompt, scene, cfg)


def content_key(content: str | bytes) -> str:
    return hashlib.sha256(content.encode("utf-8") if isinstance(content, str) else content).hexdigest()


def rank(ratings: Mapping[str, str], contents: Mapping[str, str | bytes]) -> list[str]:
    """Keys of ``ratings`` best first: by level, ties by the content hash."""
    return sorted(ratings, key=lambda k: (-LEVEL_VALUE[ratings[k]], content_key(contents[k])))


def judge(input_png: bytes, captions: Mapping[str, str], prompt: str, images: Mapping[str, bytes],
          cfg: WorldConfig | None = None, noise: float = 0.0, rng: random.Random | None = None) -> dict:
    """A judgement of one sample page (the API's JSON) from the verifier, with optional noise."""
    cfg = cfg or WorldConfig()
    rng = rng or random.Random(0)
    scene = scene_of(input_png, cfg)
    if scene is None:
        raise ValueError("the input image is not a ShapesWorld image of this world")
    out = {}
    for section, contents, rate in (
            ("understanding", captions, lambda c: rate_caption(c, scene, cfg)),
            ("generation", images, lambda b: rate_image(b, prompt, cfg))):
        ratings = {k: rate(v) for k, v in contents.items()}
        if noise:
            for k in ratings:
                if rng.random() < noise:
                    ratings[k] = rng.choice([lv for lv in LEVELS if lv != ratings[k]])
        ranking = rank(ratings, contents)
        if noise and len(ranking) > 1 and rng.random() < noise:
            i = rng.randrange(len(ranking) - 1)
            if ratings[ranking[i]] == ratings[ranking[i + 1]]:
                ranking[i], ranking[i + 1] = ranking[i + 1], ranking[i]
        out[section] = {"ratings": dict(sorted(ratings.items())), "ranking": ranking}
    return out


class ScriptedAnnotator:
    """Works through an annotator's queue over HTTP (``/api/...`` with the Bearer token)."""

    def __init__(self, base_url: str, token: str, cfg: WorldConfig | None = None, noise: float = 0.0,
                 seed: int = 0, timeout: float = 30.0):
        self.base, self.token, self.cfg, self.noise = base_url.rstrip("/"), token, cfg or WorldConfig(), noise
        self.rng, self.timeout = random.Random(seed), timeout

    def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"Authorization": f"Bearer {self.token}",
                                              **({"Content-Type": "application/json"} if data else {})})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def get_json(self, path: str) -> dict:
        code, body = self.request("GET", path)
        if code != 200:
            raise RuntimeError(f"GET {path}: {code} {body[:200]!r}")
        return json.loads(body)

    def get_bytes(self, path: str) -> bytes:
        code, body = self.request("GET", path)
        if code != 200:
            raise RuntimeError(f"GET {path}: {code}")
        return body

    def judge_sample(self, sample_id: int) -> dict:
        view = self.get_json(f"/api/samples/{sample_id}")
        captions = {o["letter"]: o["caption"] for o in view["understanding"]}
        images = {o["letter"]: self.get_bytes(o["image"]) for o in view["generation"]}
        return judge(self.get_bytes(view["input_image"]), captions, view["prompt"], images, self.cfg,
                     self.noise, self.rng)

    def submit(self, sample_id: int, payload: dict) -> int:
        code, body = self.request("POST", f"/api/samples/{sample_id}", payload)
        if code not in (200, 201):
            raise RuntimeError(f"POST sample {sample_id}: {code} {body[:200]!r}")
        return code

    def run(self, limit: int | None = None) -> int:
        """Judge the next unjudged samples (all, or ``limit``); returns how many were submitted."""
        n = 0
        while limit is None or n < limit:
            sid = self.get_json("/api/next")["sample"]
            if sid is None:
                break
            self.submit(sid, self.judge_sample(sid))
            n += 1
        return n
