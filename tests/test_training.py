"""Training: Algorithm 1 module, data module, runs, resume, NaN guard, LoRA, DDP (2 gloo processes).

Uses a tiny byte-level :class:`UnifiedModel` test double (below) and a synthetic CocoCon-schema
world written to ``tmp_path``, so the tests run in seconds on CPU.
"""

from __future__ import annotations

import inspect
import json
import math
import re
import shutil
from pathlib import Path
from typing import Sequence

import lightning as L
import pytest
import torch
from conftest import float32_tol
from torch import nn

from unicon.config import compose
from unicon.data.mixture import read_mixture
from unicon.errors import UserError
from unicon.losses.consistency import spearman_rank_loss
from unicon.models.base import Scores, UnifiedModel, check_candidates, pil_to_tensor
from unicon.training.datamodule import ConsistencyDataModule, collate_contrast
from unicon.training.module import ConsistencyModule, NonFiniteLossError, supported_tasks, task_candidates
from unicon.models import build_model, load_model
from unicon.models.checkpoints import load_for_training
from unicon.training.run import cli, train

# ---------------------------------------------------------------------------------------------
# Test double: a tiny byte-level UnifiedModel
# ---------------------------------------------------------------------------------------------
BOS, EOS, V = 256, 257, 258


class TinyUnified(UnifiedModel):
    """A tiny byte-level network (image pooling + byte embeddings + a 258-way output layer) that scores
    text, boxes and images with real, differentiable NLLs.

    Deliberately not ``standins.FakeModel``: these tests need what FakeModel is defined not to have, namely
    learning. Gradients must reach many parameters (DDP's all-reduce, resume and 1-vs-2-process equality are
    checked parameter by parameter), a ``nn.Linear`` must exist for LoRA to target, the weights must be
    saved and reloaded, and ``double_tol`` is derived from this network's reductions (V = 258, depth 3).
    FakeModel's every NLL is ``scale * crc32(inputs)``, a constant of its inputs; giving it this network as
    an option would put a second model behind every scoring method and its persistence, and the training
    tests would use none of FakeModel's generation behaviour.
    """

    backend = "tiny-double"
    caption_prompt = " what does the image describe?"

    def __init__(self, d: int = 16, seed: int = 0, nan: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.d = d
        self.img = nn.Linear(48, d)
        self.src = nn.Embedding(V, d)
        self.tgt = nn.Embedding(V, d)
        self.out = nn.Linear(d, V)
        for p in self.parameters():
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        self.nan = nan  # makes every score NaN (to test the non-finite guard)

    # ---- helpers ----------------------------------------------------------------------
    def prepare_images(self, images) -> torch.Tensor:
        x = images if torch.is_tensor(images) else pil_to_tensor(list(images))
        return nn.functional.adaptive_avg_pool2d(x.to(self.img.weight.device), 4)  # [B, 3, 4, 4]

    def _context(self, pooled: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        ids = [torch.tensor(list(p.encode()) or [BOS]) for p in prompts]
        offsets = torch.tensor([0] + [len(i) for i in ids[:-1]]).cumsum(0)
        src = nn.functional.embedding_bag(torch.cat(ids), self.src.weight, offsets, mode="mean")
        return torch.tanh(self.img(pooled.flatten(1)) + src)

    def _nll(self, ctx: torch.Tensor, targets: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """ctx [N, d], N target token lists -> (mean NLL [N], sum NLL [N])."""
        T = max(len(t) for t in targets) + 1
        tgt = torch.full((len(targets), T), EOS)
        prev = torch.full((len(targets), T), BOS)
        valid = torch.zeros(len(targets), T, dtype=torch.bool)
        for n, t in enumerate(targets):
            seq = torch.tensor(t + [EOS])
            tgt[n, : len(seq)] = seq
            prev[n, 1 : len(seq)] = seq[:-1]
            valid[n, : len(seq)] = True
        logits = self.out(torch.tanh(ctx[:, None, :] + self.tgt(prev)))
        tok = nn.functional.cross_entropy(logits.transpose(1, 2), tgt, reduction="none") * valid
        s = tok.sum(1)
        mean = s / valid.sum(1)
        if self.nan:  # a broken forward: every score non-finite
            mean, s = mean * float("nan"), s * float("nan")
        return mean, s

    def _scores(self, mean: torch.Tensor, s: torch.Tensor, counts: list[int], lengths: list[int]) -> Scores:
        B, K = len(counts), max(counts)
        mask = torch.zeros(B, K, dtype=torch.bool)
        index = []
        for b, c in enumerate(counts):
            mask[b, :c] = True
            index += [b * K + k for k in range(c)]
        index = torch.tensor(index)
        nll = mean.new_zeros(B * K).index_put((index,), mean).view(B, K)
        sum_nll = s.new_zeros(B * K).index_put((index,), s).view(B, K)
        num = torch.zeros(B * K, dtype=torch.long).index_put((index,), torch.tensor(lengths)).view(B, K)
        return Scores(nll=nll, sum_nll=sum_nll, mask=mask, num_tokens=num)

    def _image_targets(self, images) -> list[list[int]]:
        grey = self.prepare_images(images).mean(1).flatten(1)  # [B, 16]
        return (grey.clamp(0, 1) * 255).round().long().tolist()

    # ---- scoring ------------------------------------------------------------------------
    def score_text(self, images, prompts, candidates) -> Scores:
        check_candidates(candidates)
        counts = [len(c) for c in candidates]
        # images=None: text only (think-then-draw rows), as in the interface
        pooled = torch.zeros(len(prompts), 3, 4, 4) if images is None else self.prepare_images(images)
        ctx = self._context(pooled, prompts)  # once per example, reused for its K candidates
        rep = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
        targets = [list(c.encode()) for cs in candidates for c in cs]
        mean, s = self._nll(ctx[rep], targets)
        return self._scores(mean, s, counts, [len(t) + 1 for t in targets])

    def score_boxes(self, images, expressions, boxes) -> Scores:
        check_candidates(expressions, "expressions")
        counts = [len(e) for e in expressions]
        pooled = self.prepare_images(images)
        rep = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
        ctx = self._context(pooled[rep], [e for es in expressions for e in es])
        targets = [[min(255, max(0, int(v))) for v in boxes[b]] for b in rep.tolist()]
        mean, s = self._nll(ctx, targets)
        return self._scores(mean, s, counts, [5] * len(targets))

    def score_image(self, prompts, images, contexts=None) -> Scores:
        check_candidates(prompts, "prompts")
        counts = [len(p) for p in prompts]
        rep = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
        blank = torch.zeros(len(rep), 3, 4, 4)  # T2I: text-only input
        texts = [p if contexts is None else f"{p} {contexts[b]}" for b, ps in enumerate(prompts) for p in ps]
        ctx = self._context(blank, texts)
        codes = self._image_targets(images)
        targets = [codes[b] for b in rep.tolist()]
        mean, s = self._nll(ctx, targets)
        return self._scores(mean, s, counts, [17] * len(targets))

    # ---- generation (not needed by training; minimal greedy versions) ---------------------
    def caption(self, images, prompt=None, **kw):
        return ["" for _ in images]

    def answer(self, images, questions, **kw):
        return ["" for _ in questions]

    def locate(self, images, expressions):
        return torch.zeros(len(expressions), 4)

    def generate_image(self, prompts, context=None, config=None):
        raise NotImplementedError("the training test double does not generate images")

    def reason(self, prompts, max_new_tokens=256):
        raise NotImplementedError("the training test double does not generate text")

    # ---- persistence --------------------------------------------------------------------------
    def save_pretrained(self, path: str) -> None:
        p = Path(path)
        p.mkdir(parents=True, exist_ok=True)
        (p / "unicon_model.json").write_text(json.dumps({"backend": self.backend, "d": self.d}))
        torch.save(self.state_dict(), p / "weights.pt")

    @classmethod
    def from_pretrained(cls, path: str, **kwargs) -> "TinyUnified":
        p = Path(path)
        model = cls(d=json.loads((p / "unicon_model.json").read_text())["d"])
        model.load_state_dict(torch.load(p / "weights.pt"))
        return model


# ---------------------------------------------------------------------------------------------
# A synthetic CocoCon-schema world (no ShapesWorld builder needed)
# ---------------------------------------------------------------------------------------------
COLORS = ["red", "green", "blue", "yellow"]


def make_world(root: Path, n_contrast: int = 4, n_mixture: int = 8, empty_contrast_ids=()) -> Path:
    from PIL import Image

    (root / "images" / "train").mkdir(parents=True, exist_ok=True)
    rgb = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "yellow": (255, 255, 0)}
    annotations, images, mixture = [], [], []
    for i in range(max(n_contrast, n_mixture)):
        color = COLORS[i % 4]
        im = Image.new("RGB", (16, 16), (0, 0, 0))
        im.paste(rgb[color], (4, 4, 12, 12))
        name = f"images/train/{i:03d}.png"
        im.save(root / name)
        images.append({"id": i, "file_name": name, "width": 16, "height": 16})
        others = [c for c in COLORS if c != color]
        if i < n_contrast:
            contrasts = [] if i in empty_contrast_ids else [
                {"mutex_caption": f"a {c} square", "mutex_answer": c, **({"mutex_detection": f"{c} square"} if k < 2 else {})}
                for k, c in enumerate(others[: 1 + i % 3])
            ]
            ann = {"id": i, "question_id": i, "image_id": i, "caption": f"a {color} square",
                   "query": "what color is the square?", "answer": color, "contrast_sets": contrasts}
            if i % 2 == 0:
                ann.update(detection=f"{color} square", boxes=[[4, 4, 8, 8]])
            annotations.append(ann)
        if i < n_mixture:
            task = ("caption", "vqa", "grounding", "t2i", "reason")[i % 5]
            text = {"caption": None, "vqa": "what color is the square?", "grounding": f"{color} square",
                    "t2i": f"a {color} square", "reason": f"paint the square {color}, then draw it."}[task]
            target = {"caption": f"a {color} square", "vqa": color, "grounding": [4, 4, 8, 8], "t2i": None,
                      "reason": f"the square becomes {color}.\nrefined prompt: a {color} square"}[task]
            mixture.append({"id": f"m{i}", "scene_id": i, "image": None if task == "reason" else name,
                            "task": task, "text": text, "target": target, "qtype": None, "scene": {}})
    # one think-then-draw item drawn from [P, R] (trained only when data.tasks lists reason_t2i)
    mixture.append({"id": "m-drawn", "scene_id": 0, "image": images[0]["file_name"], "task": "reason_t2i",
                    "text": "paint the square red, then draw it.", "context": "refined prompt: a red square",
                    "target": None, "qtype": None, "scene": {}})
    (root / "cococon_train.json").write_text(json.dumps({"annotations": annotations, "images": images}))
    (root / "mixture_train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mixture))
    return root


def run_cfg(root: Path, out: Path, *overrides: str):
    return compose([
        "trainer=cpu", "logger=csv", "eval=none", f"data.root={root}", f"output_dir={out}",
        "data.batch_size=4", "data.contrast_batch_size=4", "trainer.enable_progress_bar=false",
        "trainer.log_every_n_steps=1", "optim.lr=1e-2", "optim.warmup_ratio=0.0", "loss.gamma=0.5",
        *overrides,
    ])


@pytest.fixture(scope="module", autouse=True)
def config_root(tmp_path_factory):
    """The repository's configs, with a minimal ``data/shapes.yaml`` if the ShapesWorld one is absent."""
    import os
    import shutil

    from unicon.config import config_dir

    root = tmp_path_factory.mktemp("configs")
    shutil.copytree(config_dir(), root, dirs_exist_ok=True)
    (root / "data").mkdir(exist_ok=True)
    if not (root / "data" / "shapes.yaml").is_file():
        (root / "data" / "shapes.yaml").write_text("root: data/shapes\n")
    old = os.environ.get("UNICON_CONFIG_DIR")
    os.environ["UNICON_CONFIG_DIR"] = str(root)
    yield root
    if old is None:
        os.environ.pop("UNICON_CONFIG_DIR")
    else:
        os.environ["UNICON_CONFIG_DIR"] = old


@pytest.fixture()
def world(tmp_path):
    return make_world(tmp_path / "world")


@pytest.fixture()
def double(monkeypatch):
    """Route build_model to the test double."""
    import unicon.models.factory

    monkeypatch.setattr(unicon.models.factory, "build_model", lambda model_cfg, world_root=None: TinyUnified())


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------
def test_rank_shares_split_the_epoch_order_and_resume_exactly():
    """Under DDP each rank reads positions rank, rank + W, ... of the epoch order (padded to a multiple
    of W); a pass resumed mid-epoch skips exactly the examples that rank fetched before."""
    from torch.utils.data import DistributedSampler

    from unicon.training.datamodule import EpochShuffleSampler, RankShare

    order = EpochShuffleSampler(11, seed=3)
    order.set_epoch(2)
    full = list(order)
    shares = [RankShare(EpochShuffleSampler(11, seed=3), 2, r) for r in range(2)]
    for share in shares:
        share.set_epoch(2)
    got = [list(s) for s in shares]
    assert got[0] == full[0::2] and got[1] == full[1::2] + full[:1]  # padded with the order's start
    assert all(len(s) == 6 and isinstance(s, DistributedSampler) for s in shares)  # Lightning keeps it
    for share, whole in zip(shares, got):
        share.skip = 4
        assert list(share) == whole[4:] and list(share) == whole  # the skip applies to one pass


def test_collator_pads_ragged_candidates_and_skips_empty(tmp_path):
    root = make_world(tmp_path, n_contrast=4, empty_contrast_ids=(1,))
    dm = ConsistencyDataModule(compose([f"data.root={root}", "data.max_contrast=2"]).data)
    dm.setup()
    batch = collate_contrast([dm.contrast[i] for i in range(4)])
    assert batch["num_skipped"] == 1 and batch["ids"] == ["0", "2", "3"]
    # sample 0 has 1 contrast, 2 has 3 (capped at 2), 3 has 1
    assert batch["candidate_mask"].tolist() == [[True, True, False], [True, True, True], [True, True, False]]
    assert batch["captions"][0] == ["a red square", "a green square"]


@pytest.mark.parametrize("row, message", [
    ('{"id": 1, "image": "x.png", "task": "vqa", "text": "q"}', "task vqa needs a non-empty string 'target'"),
    ('{"id": 1, "image": null, "task": "caption", "target": "a"}', "task caption needs 'image'"),
    ('{"id": 1, "image": null, "task": "reason", "text": "think"}', "task reason needs a non-empty string 'target'"),
    ('{"id": 1, "image": null, "task": "reason", "target": "r"}', "task reason needs a non-empty 'text'"),
    ('{"image": null, "task": "reason", "text": "t", "target": "r"}', "missing key 'id'"),
    ('{"id": 1, "image": "x.png", "task": "reason_t2i", "text": "think"}',
     "task reason_t2i needs a non-empty string 'context' (the reasoning trace)"),
])
def test_mixture_rejects_bad_rows(tmp_path, row, message):
    ok = '{"id": 0, "image": null, "task": "reason", "text": "think", "target": "trace"}'
    (tmp_path / "mixture_train.jsonl").write_text(ok + "\n" + row + "\n")
    with pytest.raises(ValueError, match=re.escape(f"mixture_train.jsonl:2: {message}")):
        read_mixture(tmp_path / "mixture_train.jsonl")


def test_mixture_tasks_select_rows_and_reason_rows_have_no_image(world):
    from unicon.data.mixture import MixtureDataset

    only_images = MixtureDataset(world, tasks=["caption", "vqa", "grounding", "t2i"])
    assert {r["task"] for r in only_images.rows} == {"caption", "vqa", "grounding", "t2i"}
    everything = MixtureDataset(world)
    reason = [everything[i] for i, r in enumerate(everything.rows) if r["task"] == "reason"]
    assert reason and all(e["image"] is None and e["target"].endswith("square") for e in reason)
    with pytest.raises(ValueError, match="unknown task"):
        MixtureDataset(world, tasks=["reasoning"])


def test_mixture_images_are_decoded_once_within_the_cache_budget(world, monkeypatch):
    """data.image_cache_mb: an image shared by several rows is decoded once; a budget smaller than
    the split evicts the least recently used images; 0 decodes every time; < 0 is refused."""
    import PIL.Image

    from unicon.data.mixture import MixtureDataset

    opened = []
    real_open = PIL.Image.open
    monkeypatch.setattr(PIL.Image, "open", lambda path, *a, **k: opened.append(str(path)) or real_open(path, *a, **k))
    data = MixtureDataset(world, tasks=["caption", "vqa", "grounding", "t2i"])
    rows = range(len(data))
    first = [data[i]["image"] for i in rows]
    again = [data[i]["image"] for i in rows]
    paths = {r["image"] for r in data.rows}
    assert len(opened) == len(paths)  # each image once, though every row was read twice
    assert all(a is b for a, b in zip(first, again))
    one_image = first[0].width * first[0].height * 3  # bytes of one decoded RGB image
    small = MixtureDataset(world, tasks=["caption"], image_cache_mb=1.5 * one_image / 2**20)
    opened.clear()
    for i in range(len(small)):
        small[i]
    assert len(small) == 2 and len(small._cache) == 1 and small._cached_bytes == one_image
    small[0]  # evicted long ago: decoded again
    assert len(opened) == len(small) + 1
    none = MixtureDataset(world, tasks=["caption"], image_cache_mb=0)
    opened.clear()
    none[0], none[0]
    assert len(opened) == 2 and not none._cache
    with pytest.raises(ValueError, match="image_cache_mb"):
        MixtureDataset(world, image_cache_mb=-1)


def test_standard_loss_trains_reason_rows_text_only(world):
    """A standard update scores think-then-draw rows as score_text(None, prompt, [trace]) and their
    drawn rows as score_image([prompt], image, contexts=[trace]) (UReason setting 2's input)."""
    from unicon.data.mixture import MixtureDataset, collate_mixture

    model = TinyUnified()
    module = ConsistencyModule(model, compose([f"data.root={world}"]))
    data = MixtureDataset(world)
    batch = collate_mixture([data[i] for i in range(len(data))])
    got = module.standard_loss(batch)["loss"]
    sums, tokens = [], []
    for task, text, target, image, context in zip(batch["tasks"], batch["texts"], batch["targets"], batch["images"],
                                                  batch["contexts"]):
        if task == "caption":
            sc = model.score_text([image], [model.caption_prompt], [[target]])
        elif task == "vqa":
            sc = model.score_text([image], [text], [[target]])
        elif task == "grounding":
            sc = model.score_boxes([image], [[text]], [target])
        elif task == "t2i":
            sc = model.score_image([[text]], [image])
        elif task == "reason_t2i":
            sc = model.score_image([[text]], [image], contexts=[context])
        else:
            assert image is None
            sc = model.score_text(None, [text], [[target]])
        sums.append(sc.sum_nll[0, 0])
        tokens.append(sc.num_tokens[0, 0])
    assert set(batch["tasks"]) == {"caption", "vqa", "grounding", "t2i", "reason", "reason_t2i"}
    # token-weighted: every target token counts once, whatever the length of its sequence
    expected = torch.stack(sums).sum() / torch.stack(tokens).sum()
    assert abs(got.item() - expected.item()) < double_tol(expected)


def test_t2i_prompt_dropout_trains_the_unconditional_model(world):
    """data.t2i_prompt_dropout: a t2i row is scored under the empty prompt (the unconditional model
    classifier-free guidance uses) for that fraction of (row, step) draws, reproducibly."""
    from unicon.data.mixture import MixtureDataset, collate_mixture

    data = MixtureDataset(world, tasks=["t2i"])
    batch = collate_mixture([data[i] for i in range(len(data))])
    model = TinyUnified()
    expected = {p: model.score_image([[t if p is None else p] for t in batch["texts"]], batch["images"]) for p in ("", None)}

    def loss(p: float) -> float:
        module = ConsistencyModule(model, compose([f"data.root={world}", f"data.t2i_prompt_dropout={p}"]))
        return module.standard_loss(batch)["loss"].item()

    for p, key in ((1.0, ""), (0.0, None)):
        sc = expected[key]
        ref = (sc.sum_nll.sum() / sc.num_tokens.sum()).item()  # float32 sums in another order
        assert abs(loss(p) - ref) <= float32_tol(int(sc.num_tokens.sum()), scale=abs(ref))
    assert loss(1.0) != loss(0.0) and loss(0.5) == loss(0.5)
    module = ConsistencyModule(model, compose([f"data.root={world}", "data.t2i_prompt_dropout=0.3"]))
    draws = [module._t2i_prompt("p", f"row{i}") for i in range(2000)]
    assert 0.25 < draws.count("") / len(draws) < 0.35  # binomial sd 0.01: a 5-sd band


def double_tol(value: torch.Tensor) -> float:
    """Batched vs one-row-at-a-time float32 scores of the byte-level test double: its longest
    reduction is the log-softmax over V = 258 entries, through 3 reducing layers (conftest.float32_tol)."""
    return float32_tol(V, float(value.abs().max()), depth=3)


# ---------------------------------------------------------------------------------------------
# Algorithm 1 pieces
# ---------------------------------------------------------------------------------------------
def _contrast_batch(root: Path, n: int = 4):
    dm = ConsistencyDataModule(compose([f"data.root={root}"]).data)
    dm.setup()
    return collate_contrast([dm.contrast[i] for i in range(n)])


def test_consistency_loss_matches_an_independent_computation(world):
    cfg = compose([f"data.root={world}", "loss.lambda_=0.25"])
    model = TinyUnified()
    module = ConsistencyModule(model, cfg)
    batch = _contrast_batch(world)
    out = module.consistency_loss(batch)
    # recompute per sample, one model call per candidate list, with the same task choices
    l0s, ce_sum, ce_tokens = [], 0.0, 0
    for sample, contrasts, image in zip(batch["samples"], batch["contrasts"], batch["images"]):
        task = module._task_rng(sample.index).choice(supported_tasks(sample, contrasts, cfg.loss.tasks))
        caps, cands = task_candidates(sample, contrasts, task)
        s0 = model.score_text([image], [model.caption_prompt], [caps])
        if task == "vqa":
            si = model.score_text([image], [sample.query], [cands])
        elif task == "localization":
            si = model.score_boxes([image], [cands], [sample.boxes[0]])
        else:
            si = model.score_image([cands], [image])
        l0s.append(spearman_rank_loss(s0.nll[0][None], si.nll[0][None]))
        ce_sum += s0.sum_nll[0, 0] + si.sum_nll[0, 0]
        ce_tokens += s0.num_tokens[0, 0] + si.num_tokens[0, 0]
    expected = 0.25 * torch.stack(l0s).mean() + ce_sum / ce_tokens
    # the soft ranks are Lipschitz (1/ε) in the rank-scaled scores, so score rounding stays at its scale
    assert abs(out["loss"].item() - expected.item()) < double_tol(expected) * 10
    assert out["loss_const"].item() > 0


def test_none_scores_gold_only_and_equals_ce(world):
    module = ConsistencyModule(TinyUnified(), compose([f"data.root={world}", "loss=none"]))
    out = module.consistency_loss(_contrast_batch(world))
    assert out["loss_const"].item() == 0.0 and out["loss"].item() == pytest.approx(out["loss_ce"].item())


def test_each_task_reports_its_training_batch_rho_for_m_and_for_k(world):
    """train/rho/<task>: the hard-rank ρ of the step's rows of that task. M computes it from the scores
    it trains on; K (loss none, gold candidates only) from a gradient-free scoring of every candidate,
    whose RNG use is forked off: K's loss, and every random draw after it, are those of a run without it."""
    batch = _contrast_batch(world)
    model = TinyUnified()
    m = ConsistencyModule(model, compose([f"data.root={world}"])).consistency_loss(batch)
    assert m["rho"] and set(m["rho"]) <= {"vqa", "localization", "t2i"}
    torch.manual_seed(0)
    k = ConsistencyModule(model, compose([f"data.root={world}", "loss=none"])).consistency_loss(batch)
    after_k = torch.rand(3)
    torch.manual_seed(0)
    gold = ConsistencyModule(model, compose([f"data.root={world}", "loss=none"])).score_contrast(batch, only_gold=True)
    assert torch.equal(torch.rand(3), after_k)  # the diagnostic pass drew nothing from the global RNG
    ce = (torch.cat(gold["gold_sum"]).sum() / torch.cat(gold["gold_tokens"]).sum()).item()
    assert k["loss"].item() == pytest.approx(ce, rel=1e-6)
    # the same rows, the same (deterministic) model: K's ρ per task is M's
    assert {t: v for t, (v, _) in k["rho"].items()} == pytest.approx({t: v for t, (v, _) in m["rho"].items()}, abs=1e-12)
    for task, (rho, rows) in m["rho"].items():
        assert -1.0 <= rho <= 1.0 and rows >= 1


def test_task_lambda_scales_each_tasks_consistency_term(world):
    """loss.task_lambda.<task> = f multiplies that task's examples' L_const terms by f (the mean is
    still over every example): 0 removes the task's term, and the factors add up linearly."""
    batch = _contrast_batch(world)
    model = TinyUnified()
    const = lambda *o: ConsistencyModule(model, compose([f"data.root={world}", *o])).consistency_loss(batch)["loss_const"].item()  # noqa: E731
    tasks = ConsistencyModule(model, compose([f"data.root={world}"])).score_contrast(batch)["tasks"]
    assert len(set(tasks)) >= 2
    full = const()
    parts = {t: const(*[f"loss.task_lambda.{u}={1.0 if u == t else 0.0}" for u in ("vqa", "localization", "t2i")])
             for t in set(tasks)}
    assert sum(parts.values()) == pytest.approx(full, rel=1e-6)
    t = next(iter(parts))
    assert const(f"loss.task_lambda.{t}=3") == pytest.approx(full + 2 * parts[t], rel=1e-6)


def test_gamma_draws_are_seeded_and_restored():
    cfg = compose(["seed=3"])
    a, b = ConsistencyModule(TinyUnified(), cfg), ConsistencyModule(TinyUnified(), cfg)
    draws_a = [a.draw_update() for _ in range(20)]
    assert draws_a == [b.draw_update() for _ in range(20)]
    assert 3 <= sum(draws_a) <= 17
    ckpt = {}
    a.on_save_checkpoint(ckpt)
    nxt = [a.draw_update() for _ in range(5)]
    c = ConsistencyModule(TinyUnified(), cfg)
    c.on_load_checkpoint(ckpt)
    assert [c.draw_update() for _ in range(5)] == nxt
    assert ckpt["unicon_config"]["seed"] == 3


# ---------------------------------------------------------------------------------------------
# Whole runs (tiny)
# ---------------------------------------------------------------------------------------------
def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_train_writes_checkpoint_config_export_and_resumes_exactly(world, tmp_path, double, optimizer):
    # 8 mixture rows / batch 4 -> 2 steps per epoch; checkpoint at every epoch end
    full = train(run_cfg(world, tmp_path / "a", "name=full", "trainer.max_epochs=2", f"optim.name={optimizer}"))
    assert full["global_step"] == 4
    run_dir = Path(full["run_dir"])
    assert (run_dir / "config.yaml").is_file() and (run_dir / "export" / "unicon_model.json").is_file()
    ckpt = torch.load(full["ckpt_path"], weights_only=False)
    assert ckpt["unicon_config"]["name"] == "full" and "gamma_rng_state" in ckpt
    assert all(k.startswith("model.") for k in ckpt["state_dict"])
    assert full["counts"]["consistency_updates"] + full["counts"]["standard_updates"] == 4

    class Interrupt(L.Callback):  # the same run, killed after its first epoch
        def on_train_epoch_end(self, trainer, pl_module):
            trainer.should_stop = True

    cfg = run_cfg(world, tmp_path / "b", "name=half", "trainer.max_epochs=2", f"optim.name={optimizer}")
    half = train(cfg, extra_callbacks=[Interrupt()])
    assert half["global_step"] == 2
    cfg.resume = half["ckpt_path"]
    resumed = train(cfg)
    assert resumed["global_step"] == 4
    assert resumed["counts"] == full["counts"]
    a, b = _losses(full["run_dir"]), _losses(resumed["run_dir"])
    assert set(a) == set(b)
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5), step
    wa = torch.load(full["ckpt_path"], weights_only=False)["state_dict"]
    wb = torch.load(resumed["ckpt_path"], weights_only=False)["state_dict"]
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k])


def test_nonfinite_loss_stops_with_step_and_ids_or_is_skipped(world, tmp_path, monkeypatch):
    import unicon.models.factory

    monkeypatch.setattr(unicon.models.factory, "build_model", lambda c, w=None: TinyUnified(nan=True))
    with pytest.raises(NonFiniteLossError, match=r"global step 0 \(batch 0, \w+ update, example ids \["):
        train(run_cfg(world, tmp_path, "trainer.max_steps=1"))
    out = train(run_cfg(world, tmp_path, "name=skip", "trainer.max_steps=2", "trainer.max_epochs=1",
                        "loss.on_nonfinite=skip"))
    assert out["counts"]["skipped_nonfinite"] == 2


def test_lora_trains_only_adapters_and_export_merges(world, tmp_path, monkeypatch):
    import unicon.models.factory

    class WithProj(TinyUnified):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(self.d, self.d)

        def _context(self, pooled, prompts):
            return self.fc1(super()._context(pooled, prompts))

    monkeypatch.setattr(unicon.models.factory, "build_model", lambda c, w=None: WithProj())
    cfg = run_cfg(world, tmp_path, "trainer.max_steps=2", "model.lora.enabled=true", "model.lora.r=2",
                  "model.lora.target_modules=[fc1]")
    model = load_for_training(cfg)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    monkeypatch.setattr("unicon.models.checkpoints.load_for_training", lambda c, resumed=None: model)
    out = train(cfg)
    state = torch.load(out["ckpt_path"], weights_only=False)["state_dict"]
    for name, value in before.items():  # frozen base weights are unchanged in the checkpoint
        torch.testing.assert_close(state[f"model.{name}"], value)
    lora_a, lora_b = state["model.fc1.lora_A.default.weight"], state["model.fc1.lora_B.default.weight"]
    assert lora_b.abs().sum() > 0  # B starts at zero: the adapters trained
    export = Path(out["export_dir"])
    assert (export / "adapter" / "adapter_config.json").is_file()
    assert (export / "adapter" / "adapter_model.safetensors").is_file()
    sd = torch.load(export / "weights.pt")
    assert "fc1.weight" in sd and not any("lora_" in k for k in sd)
    # merged weight = base + (alpha / r) * B @ A
    expected = before["fc1.base_layer.weight"] + (16 / 2) * lora_b @ lora_a
    torch.testing.assert_close(sd["fc1.weight"], expected)
    # the .ckpt of a LoRA run loads through the one checkpoint loader, adapters re-applied
    monkeypatch.setattr(unicon.models.factory, "build_model", lambda c, world_root=None: WithProj())
    reloaded, _ = unicon.models.load_lightning_checkpoint(out["ckpt_path"])
    torch.testing.assert_close(reloaded.state_dict()["fc1.lora_B.default.weight"], lora_b)


def test_gpu_accelerator_without_cuda_fails_at_start(world, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("machine has CUDA")
    with pytest.raises(UserError, match="trainer.accelerator=gpu needs CUDA"):
        train(run_cfg(world, tmp_path, "trainer.accelerator=gpu", "trainer.strategy=deepspeed_zero2"))
    assert not (tmp_path / "run").exists()


def test_cli_help_lists_groups_and_examples(capsys):
    with pytest.raises(SystemExit) as e:
        cli(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "loss" in text and "spearman" in text and "examples:" in text and "deepspeed_zero2" in text
    with pytest.raises(UserError, match="lossx"):
        cli(["lossx.type=none", "--print-config"])


# ---------------------------------------------------------------------------------------------
# DDP: 2 gloo processes == 1 process on the same data
# ---------------------------------------------------------------------------------------------
class _Record(L.Callback):
    """Rank-averaged loss per step, and each rank's γ draws, written by rank 0."""

    def __init__(self, path: str, with_params: bool = True):
        self.path, self.losses, self.kinds, self.with_params = path, [], [], with_params

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))
        self.kinds.append(pl_module.counts["consistency_updates"])

    def on_train_end(self, trainer, pl_module):
        kinds = trainer.strategy.all_gather(torch.tensor(self.kinds))
        rng = trainer.strategy.all_gather(pl_module.gamma_rng.get_state().to(torch.float32))
        if trainer.is_global_zero:
            params = {k: v.tolist() for k, v in pl_module.model.state_dict().items()} if self.with_params else {}
            Path(self.path).write_text(json.dumps({
                "losses": self.losses, "kinds": kinds.tolist(), "rng": rng.tolist(), "params": params}))


def _fit(world: Path, out: Path, devices: int, strategy, make_model=TinyUnified, with_params: bool = True) -> dict:
    bs = 8 // devices  # one step = the whole (8-example) datasets in both settings
    cfg = run_cfg(world, out, f"data.batch_size={bs}", f"data.contrast_batch_size={bs}", "seed=1")
    module = ConsistencyModule(make_model(), cfg)
    record = out / f"record{devices}.json"
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[_Record(str(record), with_params)])
    trainer.fit(module, datamodule=ConsistencyDataModule(cfg.data, seed=1))
    return json.loads(record.read_text())


@pytest.mark.slow
def test_ddp_two_gloo_processes_match_one_process(tmp_path, fork_safe_threads):
    """Exact equality needs a model without batch statistics, hence the test double (see below for OFA)."""
    world = make_world(tmp_path / "world", n_contrast=8, n_mixture=8)
    one = _fit(world, tmp_path, 1, "auto")
    two = _fit(world, tmp_path, 2, "ddp_fork")
    assert len(one["losses"]) == len(two["losses"]) == 4
    assert 0 < one["kinds"][-1] < 4  # both update kinds happened
    assert two["kinds"][0] == two["kinds"][1] == one["kinds"]  # same γ draws on both ranks
    assert two["rng"][0] == two["rng"][1]
    print("losses", one["losses"], two["losses"], one["kinds"])
    for a, b in zip(one["losses"], two["losses"]):
        assert b == pytest.approx(a, rel=1e-4)
    for k in one["params"]:
        torch.testing.assert_close(torch.tensor(two["params"][k]), torch.tensor(one["params"][k]), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_ddp_real_tiny_ofa_two_gloo_processes(tmp_path, tiny_shapes_world, fork_safe_threads):
    """The real tiny OFA under DDP: ranks use different parameter subsets per step (tasks differ), which
    needs find_unused_parameters; γ draws agree. With ``model.freeze_batchnorm`` the ResNet normalises
    with running statistics, so 2 ranks x 4 examples train exactly like 1 process x 8 examples."""
    from lightning.pytorch.strategies import DDPStrategy

    def make_model():
        torch.manual_seed(0)
        return build_model(compose(["model=ofa_shapes_tiny", "model.freeze_batchnorm=true",
                                    "model.arch.image_stem=resnet"]).model,
                           tiny_shapes_world)

    # one step = the whole dataset in both settings: 8 mixture rows, 8 contrast samples (all with contrasts)
    world = tmp_path / "world8"
    shutil.copytree(tiny_shapes_world, world)
    rows = (world / "mixture_train.jsonl").read_text().splitlines(keepends=True)
    (world / "mixture_train.jsonl").write_text("".join(rows[:8]))
    coco = json.loads((world / "cococon_train.json").read_text())
    coco["annotations"] = [a for a in coco["annotations"] if a["contrast_sets"]][:8]
    assert len(coco["annotations"]) == 8
    (world / "cococon_train.json").write_text(json.dumps(coco))
    one = _fit(world, tmp_path, 1, "auto", make_model)
    two = _fit(world, tmp_path, 2, DDPStrategy(find_unused_parameters=True, start_method="fork"), make_model)
    assert len(two["losses"]) == 4 and all(math.isfinite(x) for x in two["losses"])
    assert two["kinds"][0] == two["kinds"][1] == one["kinds"] and two["rng"][0] == two["rng"][1]
    # step 1 is the same function of the same weights: rounding only (conftest.float32_tol, the
    # largest reduction being a 3x3 convolution over the ResNet's 64 channels, through ~12 layers)
    assert abs(two["losses"][0] - one["losses"][0]) < float32_tol(9 * 64, one["losses"][0], depth=12)
    # later steps follow Adam updates: its first steps move a parameter by ~lr * sign(g), so entries
    # whose gradient is at rounding level (~0) may move either way on the two sides; their first-order
    # effect on the loss is ~0 (g ~ 0), what remains is second order in lr (1e-2 here): rel 1e-3
    for a, b in zip(one["losses"][1:], two["losses"][1:]):
        assert b == pytest.approx(a, rel=1e-3)
    bn = [k for k in one["params"] if "running_mean" in k]
    assert bn and all(one["params"][k] == two["params"][k] for k in bn)  # statistics never updated
    # Parameters are compared through the losses of steps 2-4 (computed with the updated weights): an
    # element-wise check is not meaningful under Adam, whose first steps move ~0-gradient entries by
    # ~lr * sign(g), so summation-order noise flips them.


def test_freeze_batchnorm_survives_train_mode_also_from_init_from(tiny_shapes_world, tmp_path):
    overrides = ["model=ofa_shapes_tiny", "model.freeze_batchnorm=true", "model.arch.image_stem=resnet",
                 f"data.root={tiny_shapes_world}"]  # OFA's ResNet stem (the shapes preset's patch stem has no BN)
    built = build_model(compose(overrides).model, tiny_shapes_world)
    built.save_pretrained(str(tmp_path / "export"))
    started = load_for_training(compose(overrides + [f"init_from={tmp_path / 'export'}"]))
    for model in (built, started):
        model.train()
        norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
        assert norms and not any(m.training for m in norms) and model.training
        assert not any(p.requires_grad for m in norms for p in m.parameters())


def test_ofa_scores_an_image_under_the_context_generate_image_conditions_on(tiny_shapes_world):
    """reason_t2i rows: score_image(contexts=[R]) scores exactly the input generate_image(context=[R])
    encodes, [P, R]; fit_context cuts an over-long trace from the left, keeping its conclusion."""
    from PIL import Image

    model = build_model(compose(["model=ofa_shapes_tiny", f"data.root={tiny_shapes_world}"]).model,
                        tiny_shapes_world).eval()
    image = Image.open(sorted((tiny_shapes_world / "images" / "train").glob("*.png"))[0]).convert("RGB")
    prompt, trace = "draw the board now.", "two circles stay.\nrefined prompt: two red circles"
    with torch.no_grad():
        with_context = model.score_image([[prompt]], [image], contexts=[trace])
        joined = model.score_image([[f"{prompt} {trace}"]], [image])
        alone = model.score_image([[prompt]], [image])
    assert torch.equal(with_context.sum_nll, joined.sum_nll)
    assert not torch.equal(with_context.sum_nll, alone.sum_nll)
    long = " ".join(["one red circle stays on the board."] * 40) + "\nrefined prompt: a red circle"
    kept, cut = model.fit_context([prompt], [long])
    assert cut[0] > 0 and kept[0].endswith("refined prompt: a red circle")
    ids, over = model.tokenizer.encode_text(" " + model._t2i_text(prompt, kept[0]).lstrip(), model.settings.max_source_length)
    assert not over


@pytest.mark.slow
def test_real_tiny_ofa_trains_exports_and_reloads(tiny_shapes_world, tmp_path):
    cfg = run_cfg(tiny_shapes_world, tmp_path, "model=ofa_shapes_tiny", "trainer.max_steps=3", "optim.lr=1e-3",
                  "data.max_contrast=3")
    out = train(cfg)
    assert out["global_step"] == 3 and out["counts"]["skipped_nonfinite"] == 0
    assert {"train/loss", "train/loss_ce"} <= set(out["metrics"])
    from_ckpt, from_export = load_model(out["ckpt_path"]), load_model(out["export_dir"])
    dm = ConsistencyDataModule(cfg.data)
    dm.setup()
    batch = collate_contrast([dm.contrast[i] for i in range(2)])
    with torch.no_grad():
        a = from_ckpt.score_text(batch["images"], [" what does the image describe?"] * 2, batch["captions"])
        b = from_export.score_text(batch["images"], [" what does the image describe?"] * 2, batch["captions"])
    torch.testing.assert_close(a.nll, b.nll)
    assert torch.equal(a.mask, batch["candidate_mask"])


def test_gradient_checkpointing_reaches_the_hf_backbone(tiny_shapes_world):
    from unicon.models.factory import enable_gradient_checkpointing

    model = build_model(compose(["model=ofa_shapes_tiny"]).model, tiny_shapes_world)
    enable_gradient_checkpointing(model)
    flags = [m.gradient_checkpointing for m in model.modules() if hasattr(m, "gradient_checkpointing")
             and isinstance(m.gradient_checkpointing, bool)]
    assert flags and all(flags)
    with pytest.raises(UserError, match="gradient_checkpointing"):
        enable_gradient_checkpointing(TinyUnified())


def test_pretraining_does_not_load_contrast_sets(world, tmp_path, double):
    """gamma = 0 (every step a standard update): the contrast file is neither read nor batched."""
    (world / "cococon_train.json").unlink()
    out = train(run_cfg(world, tmp_path, "loss.gamma=0", "loss=none", "trainer.max_steps=2"))
    assert out["global_step"] == 2 and out["counts"]["consistency_updates"] == 0
    with pytest.raises(UserError, match="contrast-set file"):
        train(run_cfg(world, tmp_path, "name=needs-contrast", "loss.gamma=0.5", "trainer.max_steps=1"))


def test_bench_pretrain_reports_consistent_figures(tiny_shapes_world, tmp_path):
    from unicon.bench.training import run_pretrain_bench

    cfg = compose(["experiment=shapes_pretrain", f"data.root={tiny_shapes_world}", "data.batch_size=4",
                   f"output_dir={tmp_path}"])
    out = run_pretrain_bench(cfg, steps=2, warmup=0)
    n_params = sum(p.numel() for p in build_model(cfg.model, tiny_shapes_world).parameters())
    # forward + backward of a transformer cost >= 2 FLOPs per parameter per target token
    assert out["model_flops_per_example"] > 2 * n_params
    assert out["achieved_flops_per_s"] == pytest.approx(out["examples_per_s"] * out["model_flops_per_example"],
                                                        rel=0.01)
    assert out["fraction_of_matmul_peak"] == pytest.approx(
        out["achieved_flops_per_s"] / out["matmul_peak_flops_per_s"], rel=0.01)
    assert out["kept_beside_a_busy_process"] > 0 and out["torch_threads"] == 1
    # the recipe trains on two gloo ranks: measured side by side, from the same figures
    assert out["ranks"] == cfg.trainer.devices == 2
    assert out["ranks_speedup_over_one_process"] == pytest.approx(out["ranks_examples_per_s"] / out["examples_per_s"],
                                                                  rel=0.01)
    assert out["ranks_kept_beside_a_busy_process"] == pytest.approx(
        out["ranks_examples_per_s_beside_a_busy_process"] / out["ranks_examples_per_s"], rel=0.01)
    assert out["ranks_fraction_of_matmul_peak_per_core"] == pytest.approx(
        out["ranks_examples_per_s"] * out["model_flops_per_example"] / 2 / out["matmul_peak_flops_per_s"], rel=0.02)


# ---- the mixture's epoch order (data.batching, data.task_weights) -------------------------------
def test_mixture_sampler_by_task_batches_hold_one_task_and_follow_the_weights():
    from unicon.training.datamodule import MixtureSampler

    tasks = ["vqa"] * 50 + ["caption"] * 30 + ["reason"] * 20
    s = MixtureSampler(tasks, seed=3, weights={"reason": 0.5, "caption": 2.0}, by_task=True, chunk=8)
    order = list(s)
    assert len(order) == len(s)
    batches = [order[i: i + 8] for i in range(0, len(order), 8)]
    assert all(len({tasks[i] for i in b}) == 1 for b in batches)
    per_task = {t: sum(tasks[i] == t for i in order) for t in ("vqa", "caption", "reason")}
    # round(w * n) rows, each task's last chunk filled up from its own rows
    assert per_task == {"vqa": 56, "caption": 64, "reason": 16}
    assert sorted(set(i for i in order if tasks[i] == "vqa")) == list(range(50))  # w = 1: every row once
    again = list(MixtureSampler(tasks, seed=3, weights={"reason": 0.5, "caption": 2.0}, by_task=True, chunk=8))
    assert again == order
    s.set_epoch(1)
    assert list(s) != order


def test_mixture_sampler_chunks_span_every_rank_under_ddp():
    """DDP deals positions to ranks in turn (rank r takes r, r + W, ...): with chunk = batch * W, every
    rank's batch still holds one task."""
    from unicon.training.datamodule import MixtureSampler

    tasks = ["vqa"] * 37 + ["t2i"] * 11
    W, B = 2, 4
    order = list(MixtureSampler(tasks, seed=0, by_task=True, chunk=B * W))
    for rank in range(W):
        mine = order[rank::W]
        assert all(len({tasks[i] for i in mine[k: k + B]}) == 1 for k in range(0, len(mine), B))


def test_mixture_sampler_deals_every_rank_the_same_tasks_under_ddp():
    """Mixed batches under DDP: in every step, each rank holds each task's rows give or take one; the
    epoch still holds every row once, and the steps' compositions are the one-rank shuffle's."""
    from collections import Counter

    from unicon.training.datamodule import MixtureSampler

    tasks = ["vqa"] * 40 + ["caption"] * 20 + ["reason"] * 7 + ["t2i"] * 13
    W, B = 2, 8
    order = list(MixtureSampler(tasks, seed=1, chunk=B * W, ranks=W))
    assert sorted(order) == list(range(len(tasks)))
    plain = list(MixtureSampler(tasks, seed=1, chunk=B * W))
    steps = range(0, len(order), B * W)
    assert all(sorted(order[c: c + B * W]) == sorted(plain[c: c + B * W]) for c in steps)
    unbalanced = 0
    for c in steps:
        counts = [Counter(tasks[i] for i in order[c: c + B * W][r::W]) for r in range(W)]
        assert all(abs(counts[0][t] - counts[1][t]) <= 1 for t in set(tasks)), (c, counts)
        plain_counts = [Counter(tasks[i] for i in plain[c: c + B * W][r::W]) for r in range(W)]
        unbalanced += any(abs(plain_counts[0][t] - plain_counts[1][t]) > 1 for t in set(tasks))
    assert unbalanced  # the plain deal of this seed does leave a rank with more of a task


def test_mixture_sampler_mixed_order_and_bad_weights():
    from unicon.errors import UserError
    from unicon.training.datamodule import MixtureSampler

    tasks = ["vqa"] * 10 + ["caption"] * 10
    order = list(MixtureSampler(tasks, seed=0, weights={"caption": 0.0}))
    assert sorted(order) == list(range(10))
    with pytest.raises(UserError, match="leave no mixture row"):
        MixtureSampler(tasks, weights={"caption": 0.0, "vqa": 0.0})


def test_task_weights_and_batching_are_validated_with_their_key():
    from unicon.config import ConfigError, compose

    with pytest.raises(ConfigError, match=r"command line: data.task_weights.captions=2.0 names no mixture task"):
        compose(["data.task_weights.captions=2"])
    with pytest.raises(ConfigError, match=r"data.task_weights.vqa=-1.0 must be a number >= 0"):
        compose(["data.task_weights.vqa=-1"])
    with pytest.raises(ConfigError, match=r"data.batching='per_task' is not one of: auto, mixed, by_task"):
        compose(["data.batching=per_task"])


def test_ddp_broadcasts_buffers_only_for_models_with_running_statistics():
    """DDP copies rank 0's buffers to every rank before each forward. The patch-stem OFA's buffers are
    constants of its config (relative-position buckets), so the strategy skips the broadcast; a ResNet
    stem's BatchNorm running statistics keep it."""
    from lightning.pytorch.strategies import DDPStrategy

    from unicon.models.ofa.configuration_ofa import preset_config
    from unicon.models.ofa.modeling_ofa import OFAForConditionalGeneration
    from unicon.training.strategy import keeps_running_statistics, make_strategy

    patch = OFAForConditionalGeneration(preset_config("shapes-tiny", vocab_size=300, d_model=32))
    resnet = OFAForConditionalGeneration(preset_config("shapes-tiny", vocab_size=300, d_model=32, image_stem="resnet"))
    assert list(patch.buffers()) and not keeps_running_statistics(patch)  # buffers, but constant ones
    assert keeps_running_statistics(resnet)
    # the keyword of the torch installed: broadcast_buffers is deprecated since torch 2.13
    sync = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(
        torch.nn.parallel.DistributedDataParallel).parameters else "broadcast_buffers"
    for broadcast in (True, False):
        strategy = make_strategy("ddp", broadcast_buffers=broadcast)
        assert isinstance(strategy, DDPStrategy)
        assert strategy._ddp_kwargs == {"find_unused_parameters": True, sync: broadcast}


def test_bench_train_loop_reports_the_loop_beside_the_bare_step(world, tmp_path, double, capsys):
    """``unicon bench train --loop``: both throughputs, measured on the same examples, and their ratio."""
    from unicon.bench.training import cli as bench_cli

    overrides = [f"data.root={world}", f"output_dir={tmp_path / 'unused'}", "trainer=cpu", "logger=csv", "eval=none",
                 "data.batch_size=4", "data.contrast_batch_size=4", "loss.gamma=0.5", "trainer.enable_progress_bar=false",
                 "trainer.log_every_n_steps=1"]
    assert bench_cli(["--loop", "--steps", "3", "--warmup", "1", "--rounds", "2", *overrides]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["same_examples"] and out["steps"] == 3 and out["rounds"] == 2
    assert out["bare_step_examples_per_s"] > 0 and out["lightning_loop_examples_per_s"] > 0
    assert out["loop_fraction_of_bare"] == pytest.approx(
        out["lightning_loop_examples_per_s"] / out["bare_step_examples_per_s"], rel=0.01)
    assert out["bare_step_examples_per_s"] == pytest.approx(
        out["examples_per_step"] / out["bare_ms_per_step"] * 1e3, rel=0.01)
    assert out["lightning_loop_examples_per_s"] == pytest.approx(
        out["examples_per_step"] / out["loop_ms_per_step"] * 1e3, rel=0.01)
    assert len(out["loop_fraction_of_bare_per_round"]) == 2
    assert not (tmp_path / "unused").exists()  # the loop's run folders live in a temporary directory


def test_bench_rank_regime_reports_each_tasks_scores_and_gradients(world, tmp_path, double, capsys):
    """``unicon bench train --rank-regime``: per task, the spread of the ranked scores, the soft-rank
    regime of each variant and the gradient L_const sends through each side, all finite."""
    from unicon.bench.training import RANK_VARIANTS, cli as bench_cli

    overrides = [f"data.root={world}", f"output_dir={tmp_path / 'unused'}", "trainer=cpu", "logger=csv", "eval=none",
                 "data.contrast_batch_size=2"]
    assert bench_cli(["--rank-regime", "--steps", "2", *overrides]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["batches"] == 2 and out["tasks"]
    for stats in out["tasks"].values():
        assert stats["score_std"] > 0 and stats["anchor_score_std"] > 0 and -1 <= stats["rho_hard"] <= 1
        assert stats["grad_ce"] > 0
        for soft_rank, eps in RANK_VARIANTS:
            name = f"{soft_rank}@{eps:g}"
            assert 0 <= stats[f"{name}/merged_rows"] <= 1 and stats[f"{name}/soft_hard_gap"] >= 0
            assert stats[f"{name}/grad_task_side"] > 0 and stats[f"{name}/grad_anchor_side"] > 0
        # the run's own consistency step under its clipping (trainer=cpu clips at 1.0)
        assert stats["clipping/grad_rank"] > 0 and -1 <= stats["clipping/cos_ce_rank"] <= 1
        assert 0 < stats["clipping/clip_factor"] <= 1 and 0 < stats["clipping/ce_kept"]


def test_clipping_shares_by_hand():
    """g_ce = (3, 0), g_rank = (0, 4): g = (3, 4), ‖g‖ = 5; clipped to 1 the step keeps a fifth of it,
    its CE part 3/5 where a CE-only step (‖g_ce‖ = 3) would apply 1; ⟨g_ce, g⟩/‖g‖² = 9/25."""
    from unicon.bench.training import clipping_shares

    out = clipping_shares(torch.tensor([3.0, 0.0], dtype=torch.float64), torch.tensor([0.0, 4.0], dtype=torch.float64), 1.0)
    assert out == pytest.approx({"grad_rank": 4.0, "cos_ce_rank": 0.0, "clip_factor": 0.2, "ce_share": 0.36,
                                 "ce_kept": 0.6}, abs=1e-12)
    unclipped = clipping_shares(torch.tensor([3.0, 0.0], dtype=torch.float64), torch.tensor([0.0, 4.0], dtype=torch.float64), 0.0)
    assert unclipped["clip_factor"] == 1.0 and unclipped["ce_kept"] == 1.0
