"""Loader for GenEval metadata files (one JSON object per line).

Three public producers share one schema, and ShapesWorld writes a fourth:

* GenEval's ``evaluation_metadata.jsonl`` -- 553 short prompts ("a photo of a bench");
* BAGEL's ``evaluation_metadata_long_bagel.jsonl`` -- the same rows with ``prompt`` replaced by a
  long LLM rewrite;
* BLIP3-o's ``geneval_prompt_blip3o_rewritten.jsonl`` -- the original rows plus ``detailed_caption``
  (the long rewrite, the "GenEval-R" prompts of the Telephone-Game paper) and ``index``;
* ShapesWorld's ``geneval_metadata.jsonl`` -- the same schema with the world's shapes and colours.

A row is::

    {"tag": "position",
     "include": [{"class": "teddy bear", "count": 1},
                 {"class": "dog", "count": 1, "position": ["right of", 0]}],
     "exclude": [{"class": "clock", "count": 3}],          # optional (counting prompts)
     "prompt": "a photo of a dog right of a teddy bear",
     "detailed_caption": "...", "index": "00042"}          # optional (BLIP3-o)

``position: [relation, j]`` means "this object is <relation> the objects matched by include
clause ``j``" (``j`` must refer to an earlier clause). Any problem raises
:class:`GenEvalFormatError` naming the file and the 1-based line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unicon.data.jsonl import read_jsonl
from unicon.errors import UserError

#: GenEval's six tasks, in the order of its summary table.
TASKS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
RELATIONS = ("left of", "right of", "above", "below")


class GenEvalFormatError(UserError, ValueError):
    """A GenEval metadata file is unusable; the message names the file and line."""


@dataclass(frozen=True)
class Requirement:
    """One ``include``/``exclude`` clause: at least (resp. fewer than) ``count`` objects of ``cls``."""

    cls: str
    count: int
    color: str | None = None
    position: tuple[str, int] | None = None  # (relation, index of the reference include clause)


@dataclass(frozen=True)
class GenEvalPrompt:
    """One GenEval prompt with its object-level requirements."""

    index: int  # 0-based row number in the file (the BLIP3-o ``index`` when present)
    tag: str
    prompt: str
    include: tuple[Requirement, ...]
    exclude: tuple[Requirement, ...] = ()
    detailed_caption: str | None = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def id(self) -> str:
        return f"{self.index:05d}"

    def text(self, long: bool = False) -> str:
        """The prompt fed to T2I: ``detailed_caption`` when ``long`` (must exist), else ``prompt``."""
        if long:
            if self.detailed_caption is None:
                raise GenEvalFormatError(
                    f"prompt {self.id} has no 'detailed_caption'; long prompts need the BLIP3-o rewrite "
                    "file (or use BAGEL's long file, whose 'prompt' is already long, with long=False)"
                )
            return self.detailed_caption
        return self.prompt


def _requirement(obj: Any, where: str, kind: str, n_before: int) -> Requirement:
    if not isinstance(obj, dict):
        raise GenEvalFormatError(f"{where}: each '{kind}' clause must be an object, got {type(obj).__name__}")
    cls, count = obj.get("class"), obj.get("count")
    if not isinstance(cls, str) or not cls:
        raise GenEvalFormatError(f"{where}: '{kind}' clause {obj} has no non-empty 'class'")
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise GenEvalFormatError(f"{where}: '{kind}' clause for {cls!r} needs an integer 'count' >= 1, "
                                 f"got {count!r}")
    color = obj.get("color")
    if color is not None and (not isinstance(color, str) or not color):
        raise GenEvalFormatError(f"{where}: 'color' of {cls!r} must be a non-empty string, got {color!r}")
    position = obj.get("position")
    if position is not None:
        if kind != "include":
            raise GenEvalFormatError(f"{where}: 'position' is only allowed in 'include' clauses")
        ok = (
            isinstance(position, (list, tuple))
            and len(position) == 2
            and position[0] in RELATIONS
            and isinstance(position[1], int)
            and 0 <= position[1] < n_before
        )
        if not ok:
            raise GenEvalFormatError(
                f"{where}: 'position' of {cls!r} must be [relation, j] with relation in {list(RELATIONS)} "
                f"and j an earlier include clause (< {n_before}), got {position!r}"
            )
        position = (position[0], position[1])
    return Requirement(cls=cls, count=count, color=color, position=position)


def parse_row(row: Any, where: str, row_number: int) -> GenEvalPrompt:
    """Validate one decoded JSON row; ``where`` is ``"<file>:<line>"`` for error messages."""
    if not isinstance(row, dict):
        raise GenEvalFormatError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for key in ("tag", "include", "prompt"):
        if key not in row:
            raise GenEvalFormatError(f"{where}: missing key '{key}'")
    tag, prompt = row["tag"], row["prompt"]
    if not isinstance(tag, str) or not tag:
        raise GenEvalFormatError(f"{where}: 'tag' must be a non-empty string, got {tag!r}")
    if not isinstance(prompt, str) or not prompt.strip():
        raise GenEvalFormatError(f"{where}: 'prompt' must be a non-empty string")
    if not isinstance(row["include"], list) or not row["include"]:
        raise GenEvalFormatError(f"{where}: 'include' must be a non-empty list")
    include = []
    for clause in row["include"]:
        include.append(_requirement(clause, where, "include", len(include)))
    exclude_raw = row.get("exclude", [])
    if not isinstance(exclude_raw, list):
        raise GenEvalFormatError(f"{where}: 'exclude' must be a list")
    exclude = tuple(_requirement(c, where, "exclude", 0) for c in exclude_raw)
    detailed = row.get("detailed_caption")
    if detailed is not None and (not isinstance(detailed, str) or not detailed.strip()):
        raise GenEvalFormatError(f"{where}: 'detailed_caption' must be a non-empty string")
    index = row_number
    if "index" in row:
        try:
            index = int(row["index"])
        except (TypeError, ValueError):
            raise GenEvalFormatError(f"{where}: 'index' must be an integer, got {row['index']!r}") from None
    return GenEvalPrompt(
        index=index, tag=tag, prompt=prompt, include=tuple(include), exclude=exclude,
        detailed_caption=detailed, raw=row,
    )


#: GenEval-R, the Telephone-Game paper's MGG prompts: BLIP3-o's long rewrites (``detailed_caption``)
GENEVAL_R = Path("geneval") / "geneval_prompt_blip3o_rewritten.jsonl"


def geneval_r_path(data_dir: str | Path | None = None) -> Path:
    """``<data_dir>/geneval/geneval_prompt_blip3o_rewritten.jsonl``; ``data_dir`` defaults to
    ``$UNICON_SHARED_DIR/data``, else ``../shared/data`` beside the checkout. A missing file is a
    UserError naming the path and the way out."""
    if data_dir is None:
        shared = os.environ.get("UNICON_SHARED_DIR") or Path(__file__).resolve().parents[3].parent / "shared"
        data_dir = Path(shared) / "data"
    path = Path(data_dir) / GENEVAL_R
    if not path.is_file():
        raise UserError(f"no GenEval-R prompts at {path} (the default MGG seeds outside ShapesWorld): copy "
                        "BLIP3-o's geneval_prompt_blip3o_rewritten.jsonl there, set UNICON_SHARED_DIR, "
                        "give --geneval FILE, or --geneval none to skip MGG")
    return path


def load_geneval(path: str | Path, tasks: tuple[str, ...] | None = TASKS) -> list[GenEvalPrompt]:
    """Read a GenEval metadata JSONL file.

    ``tasks``: the allowed ``tag`` values (GenEval's six by default; ``None`` accepts any tag, e.g. a
    world with its own task set). Blank lines are skipped; every other line must be a valid row.
    Duplicate ``index`` values are an error (they are the join key of the chain files).
    """
    path = Path(path)
    prompts: list[GenEvalPrompt] = []
    seen: dict[int, int] = {}
    for lineno, row in read_jsonl(path, GenEvalFormatError, "GenEval metadata file"):
        where = f"{path}:{lineno}"
        prompt = parse_row(row, where, len(prompts))
        if tasks is not None and prompt.tag not in tasks:
            raise GenEvalFormatError(f"{where}: unknown tag {prompt.tag!r} (expected {list(tasks)})")
        if prompt.index in seen:
            raise GenEvalFormatError(f"{where}: index {prompt.index} already used on line {seen[prompt.index]}")
        seen[prompt.index] = lineno
        prompts.append(prompt)
    if not prompts:
        raise GenEvalFormatError(f"{path}: no prompts (the file is empty)")
    return prompts
