"""RealUnify instances from the files ``--data`` names: a ShapesWorld root, GEU parquet files in the
public release's layout, or a UEG JSONL file.

``--data`` may be

* a **ShapesWorld root** (it has ``world.json``): ``<root>/realunify/ueg.jsonl`` and
  ``<root>/realunify/geu.jsonl`` (written by ``unicon build-data shapes``;
  :mod:`unicon.worlds.shapes_realunify`), GEU images relative to the root;
* a **GEU parquet file** in the layout of the public release (``lmms-lab-eval/RealUnify`` on the
  Hugging Face hub, one config per GEU task, as lmms-eval's ``tasks/realunify`` reads it), one row per
  question with the columns

  - ``image``: ``{"bytes": <encoded image>, "path": <name>}`` (the ``datasets`` Image feature), or bytes;
  - ``evaluation_prompt`` (or ``prompt``): the multiple-choice prompt as the model gets it, holding the
    four options as lines ``A. <text>`` .. ``D. <text>`` (``A)``, ``(A)`` and ``A:`` are read too);
  - ``question``: the question alone (what Tables 11-13 quote); optional -- without it, the text of
    the prompt without its option lines, its ``Option:`` header, its ``The best answer is:`` line and
    Table 8's instruction sentence;
  - ``answer``: the correct letter ``A``-``D``;
  - ``task_type``: the GEU category (``mental_tracking``...; spaces and case normalised);
  - optional ``options`` (a list of four strings: read instead of the prompt's option lines) and
    ``id``/``index`` (else the row number);

* a **folder** of such parquet files (every ``*.parquet`` below it, in name order);
* a **UEG JSONL** file, one instance per line:
  ``{"id", "category", "prompt", "questions": [{"question", "answer": "yes"|"no", "check"?}, ...]}``
  (``question_list`` and ``task_type``, the field names of the authors' evaluation script, are read
  as ``questions`` and ``category``).

Every malformed row -- a missing column or field, an image whose bytes do not decode (or a missing
image file), options that are not four, an answer that is not a letter A-D (GEU) or yes/no (UEG), a
category that is not one of the paper's (:data:`UEG_CATEGORIES`, :data:`GEU_CATEGORIES`) -- is a
:class:`UserError` whose one line names the file and the row (0-based row of a parquet file, 1-based
line of a JSONL file). So are a file without rows and two instances of a category with one id (their
images would be saved to one file, ``images/<setting>/<category>_<id>.png``): the line names both rows.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from PIL import Image, UnidentifiedImageError

from unicon.data.jsonl import read_jsonl
from unicon.errors import UserError
from unicon.evaluation.realunify.prompts import LETTERS

#: the paper's UEG categories (Table 6 order)
UEG_CATEGORIES = ("world_knowledge", "commonsense_reasoning", "mathematical_reasoning", "logical_reasoning",
                  "scientific_reasoning", "code_to_image")
#: the paper's GEU categories (Table 6 order)
GEU_CATEGORIES = ("mental_reconstruction", "mental_tracking", "attentional_focusing", "cognitive_navigation")
AXES = ("ueg", "geu")


@dataclass
class UEGInstance:
    """A UEG prompt and its polling questions (``answer`` of each: the expected ``yes``/``no``)."""

    id: str
    category: str
    prompt: str
    questions: list[dict]
    source: str = ""  # "<file>:<line>"
    axis: str = "ueg"

    @property
    def key(self) -> str:
        return f"{self.category}_{_safe(self.id)}"


@dataclass
class GEUInstance:
    """A GEU multiple-choice question on an image; ``target_scene``: the exact scene a correct
    stepwise edit draws (ShapesWorld only)."""

    id: str
    category: str
    question: str
    options: list[str]
    answer: str
    source: str = ""  # "<file>:row <i>" or "<file>:<line>"
    image_bytes: bytes | None = None
    image_path: str | None = None
    target_scene: dict | None = None
    edit_instruction: str | None = None
    #: the question as it reads of the stepwise edit's result (ShapesWorld rows; None: ``question`` is asked)
    stepwise_question: str | None = None
    #: read from a ShapesWorld root's ``geu.jsonl`` (False: the public release's parquet layout); what
    #: ``stepwise_input="auto"`` is resolved by (:func:`~.runner.resolve_stepwise_input`)
    from_world: bool = False
    axis: str = "geu"

    @property
    def key(self) -> str:
        return f"{self.category}_{_safe(self.id)}"

    def image(self) -> Image.Image:
        """The question's image, RGB."""
        if self.image_bytes is not None:
            with Image.open(io.BytesIO(self.image_bytes)) as im:
                return im.convert("RGB")
        with Image.open(self.image_path) as im:
            return im.convert("RGB")


Instance = UEGInstance | GEUInstance


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", str(text))


def normalize_category(name: str) -> str:
    """``"Mental Tracking"`` / ``"mental-tracking"`` -> ``"mental_tracking"``."""
    return re.sub(r"[\s\-]+", "_", str(name).strip()).lower()


# ---------------------------------------------------------------------------------------------
# option and question parsing (the release's evaluation_prompt)
# ---------------------------------------------------------------------------------------------
_OPTION_LINE = re.compile(r"^\s*\(?([A-D])\s*[.):]\s*(.*?)\s*$")
_INSTRUCTION = re.compile(r"^\s*Select the best answer\b.*$", re.IGNORECASE)
_BOILERPLATE = re.compile(r"^\s*(Options?\s*:?|The best answer is\s*:?|Answer\s*:?)\s*$", re.IGNORECASE)


def parse_options(text: str) -> list[str] | None:
    """The four options of a prompt: its lines ``A. x``, ``B. x``, ``C. x``, ``D. x`` (also ``A)``,
    ``(A)``, ``A:``), each letter once and in order; None when the prompt does not hold exactly that."""
    found = [(m.group(1), m.group(2)) for m in map(_OPTION_LINE.match, str(text).splitlines()) if m]
    if [letter for letter, _ in found] != list(LETTERS) or any(not body for _, body in found):
        return None
    return [body for _, body in found]


def strip_prompt(text: str) -> str:
    """A multiple-choice prompt without its option lines, ``Option:`` header, final ``The best answer
    is:`` line and Table 8's instruction sentence; a leading ``Question:`` dropped."""
    kept = [ln for ln in str(text).splitlines()
            if not (_OPTION_LINE.match(ln) or _BOILERPLATE.match(ln) or _INSTRUCTION.match(ln))]
    out = "\n".join(kept).strip()
    return re.sub(r"^Question\s*:\s*", "", out, flags=re.IGNORECASE).strip()


# ---------------------------------------------------------------------------------------------
# parquet (GEU, public release layout)
# ---------------------------------------------------------------------------------------------
GEU_PROMPT_COLUMNS = ("evaluation_prompt", "prompt")
GEU_REQUIRED = ("image", "answer", "task_type")


def _decode_image(value: Any, where: str) -> bytes:
    """The encoded bytes of a parquet image cell, checked to decode."""
    data = value.get("bytes") if isinstance(value, dict) else value
    if not isinstance(data, (bytes, bytearray)) or not data:
        raise UserError(f"{where}: column 'image' holds no image bytes (expected {{'bytes': ..., 'path': ...}})")
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise UserError(f"{where}: the image bytes do not decode ({type(e).__name__}: {str(e).splitlines()[0]})") \
            from None
    return bytes(data)


def _check_answer(answer: Any, where: str) -> str:
    if not isinstance(answer, str) or answer.strip() not in LETTERS:
        raise UserError(f"{where}: answer {answer!r} is not one of the letters A, B, C, D")
    return answer.strip()


def _geu_from_parquet_row(row: dict, where: str, index: int) -> GEUInstance:
    missing = [c for c in GEU_REQUIRED if row.get(c) is None]
    prompt_col = next((c for c in GEU_PROMPT_COLUMNS if isinstance(row.get(c), str) and row[c].strip()), None)
    if prompt_col is None and not isinstance(row.get("options"), (list, tuple)):
        missing.append("evaluation_prompt")
    if missing:
        raise UserError(f"{where}: missing column(s) {', '.join(missing)}")
    answer = _check_answer(row["answer"], where)
    options = row.get("options")
    if options is not None:
        options = [str(o) for o in options]
        if len(options) != 4:
            raise UserError(f"{where}: column 'options' holds {len(options)} options, not 4")
    else:
        options = parse_options(row[prompt_col])
        if options is None:
            raise UserError(f"{where}: column {prompt_col!r} does not hold the four options as lines "
                            "'A. ...' to 'D. ...'")
    question = row.get("question")
    if not isinstance(question, str) or not question.strip():
        if prompt_col is None:
            raise UserError(f"{where}: missing column(s) question")
        question = row[prompt_col]
    question = strip_prompt(question)
    if not question:
        raise UserError(f"{where}: the question is empty")
    category = normalize_category(row["task_type"])
    if category not in GEU_CATEGORIES:
        raise UserError(f"{where}: task_type {row['task_type']!r} is not a GEU category "
                        f"({', '.join(GEU_CATEGORIES)})")
    ident = row.get("id", row.get("index", index))
    return GEUInstance(id=str(ident), category=category, question=question, options=options, answer=answer,
                       source=where, image_bytes=_decode_image(row["image"], where))


def read_parquet(path: str | Path) -> list[GEUInstance]:
    """The GEU instances of one parquet file of the public release (module docstring)."""
    import pyarrow.parquet as pq  # lazy: pyarrow is only needed for parquet input

    path = Path(path)
    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 -- pyarrow raises several types for a file it cannot read
        raise UserError(f"{path}: not a readable parquet file ({type(e).__name__}: {str(e).splitlines()[0]})") \
            from None
    return _nonempty([_geu_from_parquet_row(row, f"{path}: row {i}", i) for i, row in enumerate(table.to_pylist())],
                     path)


def _nonempty(instances: list, path: Path) -> list:
    """``instances``; a file without rows is a :class:`UserError` naming it."""
    if not instances:
        raise UserError(f"{path}: holds no rows (a RealUnify data file needs at least one instance)")
    return instances


# ---------------------------------------------------------------------------------------------
# JSONL (UEG documented layout; ShapesWorld GEU)
# ---------------------------------------------------------------------------------------------
def _jsonl_rows(path: Path) -> Iterable[tuple[str, dict]]:
    """``("file:line", row)`` of every row (:func:`unicon.data.jsonl.read_jsonl`: a malformed line is
    an error naming the file, line and column)."""
    for lineno, row in read_jsonl(path, what="RealUnify JSONL file"):
        yield f"{path}:{lineno}", row


def ueg_from_row(row: dict, where: str) -> UEGInstance:
    """One UEG instance from a JSONL row (module docstring)."""
    questions = row.get("questions", row.get("question_list"))
    category = row.get("category", row.get("task_type"))
    missing = [name for name, v in (("id", row.get("id")), ("category", category), ("prompt", row.get("prompt")),
                                    ("questions", questions)) if v is None]
    if missing:
        raise UserError(f"{where}: missing field(s) {', '.join(missing)}")
    if not isinstance(row["prompt"], str) or not row["prompt"].strip():
        raise UserError(f"{where}: 'prompt' is empty")
    if not isinstance(questions, list) or not questions:
        raise UserError(f"{where}: 'questions' must be a non-empty list of {{question, answer}}")
    if normalize_category(category) not in UEG_CATEGORIES:
        raise UserError(f"{where}: category {category!r} is not a UEG category ({', '.join(UEG_CATEGORIES)})")
    for k, q in enumerate(questions):
        if not isinstance(q, dict) or not isinstance(q.get("question"), str) or not q["question"].strip():
            raise UserError(f"{where}: question {k} has no 'question' text")
        if q.get("answer") not in ("yes", "no"):
            raise UserError(f"{where}: question {k} has answer {q.get('answer')!r}, not 'yes' or 'no'")
    return UEGInstance(id=str(row["id"]), category=normalize_category(category), prompt=row["prompt"],
                       questions=[dict(q) for q in questions], source=where)


def read_ueg_jsonl(path: str | Path) -> list[UEGInstance]:
    """The UEG instances of a JSONL file (module docstring)."""
    path = Path(path)
    return _nonempty([ueg_from_row(row, where) for where, row in _jsonl_rows(path)], path)


def read_geu_jsonl(path: str | Path, root: str | Path) -> list[GEUInstance]:
    """The GEU instances of a ShapesWorld ``geu.jsonl`` (images relative to ``root``)."""
    path, root = Path(path), Path(root)
    out = []
    for where, row in _jsonl_rows(path):
        missing = [c for c in ("id", "category", "image", "question", "options", "answer") if row.get(c) is None]
        if missing:
            raise UserError(f"{where}: missing field(s) {', '.join(missing)}")
        answer = _check_answer(row["answer"], where)
        if not isinstance(row["options"], list) or len(row["options"]) != 4:
            raise UserError(f"{where}: 'options' must be a list of 4 strings")
        image = root / row["image"]
        if not image.is_file():
            raise UserError(f"{where}: image {image} does not exist")
        category = normalize_category(row["category"])
        if category not in GEU_CATEGORIES:
            raise UserError(f"{where}: category {row['category']!r} is not a GEU category ({', '.join(GEU_CATEGORIES)})")
        out.append(GEUInstance(id=str(row["id"]), category=category, question=row["question"],
                               options=[str(o) for o in row["options"]], answer=answer, source=where,
                               image_path=str(image), target_scene=row.get("target_scene"),
                               edit_instruction=row.get("edit_instruction"),
                               stepwise_question=row.get("stepwise_question"), from_world=True))
    return _nonempty(out, path)


# ---------------------------------------------------------------------------------------------
# --data
# ---------------------------------------------------------------------------------------------
def world_root_of(data: str | Path) -> Path | None:
    """``data`` when it is a ShapesWorld root (has ``world.json``), else None."""
    p = Path(data)
    return p if p.is_dir() and (p / "world.json").is_file() else None


def check_unique(instances: Iterable[Instance]) -> None:
    """Refuse two instances with one :attr:`~GEUInstance.key` (category and id, the name of their saved
    images): a :class:`UserError` naming both rows and ids."""
    seen: dict[str, Instance] = {}
    for inst in instances:
        first = seen.get(inst.key)
        seen.setdefault(inst.key, inst)
        if first is not None:
            other = "" if first.id == inst.id else f" (id {first.id!r})"
            raise UserError(f"{inst.source}: id {inst.id!r} ({inst.category}) repeats {first.source}{other}; "
                            "the instances of a category need distinct ids (their images are saved as "
                            f"images/<setting>/{inst.key}.png)")


def load_instances(data: str | Path) -> list[Instance]:
    """Every instance ``--data`` names (module docstring): UEG ones first, each file in its order;
    ids distinct per category (:func:`check_unique`)."""
    instances = _load(data)
    check_unique(instances)
    return instances


def _load(data: str | Path) -> list[Instance]:
    p = Path(data)
    if not p.exists():
        raise UserError(f"--data {p} does not exist")
    root = world_root_of(p)
    if root is not None:
        ueg, geu = root / "realunify" / "ueg.jsonl", root / "realunify" / "geu.jsonl"
        if not ueg.is_file() and not geu.is_file():
            raise UserError(f"--data {p}: the world has no realunify/ueg.jsonl or realunify/geu.jsonl; rebuild it "
                            f"with `unicon build-data shapes --out {p}`")
        return [*(read_ueg_jsonl(ueg) if ueg.is_file() else []), *(read_geu_jsonl(geu, root) if geu.is_file() else [])]
    if p.is_dir():
        files = sorted(p.rglob("*.parquet"))
        if not files:
            raise UserError(f"--data {p}: a folder without world.json must hold GEU .parquet files; it has none")
        return [inst for f in files for inst in read_parquet(f)]
    if p.suffix == ".parquet":
        return list(read_parquet(p))
    if p.suffix == ".jsonl":
        return list(read_ueg_jsonl(p))
    raise UserError(f"--data {p}: expected a ShapesWorld root, a .parquet file or folder of them, or a UEG .jsonl file")


def ordered_categories(categories: Iterable[str]) -> list[str]:
    """The distinct categories in the paper's order (UEG then GEU; unknown ones after, sorted)."""
    seen = set(categories)
    known = [c for c in (*UEG_CATEGORIES, *GEU_CATEGORIES) if c in seen]
    return known + sorted(seen - set(known))


def axis_of(category: str) -> str:
    """``"geu"`` for a GEU category, else ``"ueg"``."""
    return "geu" if category in GEU_CATEGORIES else "ueg"


def subset(instances: Sequence[Instance], per_category: int | None) -> list[Instance]:
    """The first ``per_category`` instances of each category, in the input order (None: all)."""
    if per_category is None:
        return list(instances)
    seen: dict[str, int] = {}
    out = []
    for inst in instances:
        if seen.get(inst.category, 0) < per_category:
            seen[inst.category] = seen.get(inst.category, 0) + 1
            out.append(inst)
    return out
