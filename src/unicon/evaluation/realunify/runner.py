"""RealUnify's two settings over instances: model calls, judging, per-sample records and files,
sharded over ranks.

For every instance, in the settings asked for (``direct``, ``stepwise``):

* UEG direct: ``model.generate_image([prompt])``; UEG stepwise: ``model.reason([Table 9(prompt)])``
  gives the refined prompt (whitespace and wrapping quotes stripped), then
  ``model.generate_image([refined])`` (an empty refined prompt draws nothing: a failure). Both images
  are polled by the judge (:mod:`.judges`);
* GEU direct: ``model.answer([image], [Table 8(question, options)])`` (``answer_mode="generate"``,
  the paper's protocol), the letter read from the reply strictly or, with ``letter_parse="lenient"``,
  as the authors' scorer reads it (:mod:`.judges`; recorded in ``realunify.json``), or, with
  ``answer_mode="likelihood"`` (our
  addition, for models never trained on Table 8's format, e.g. a ShapesWorld model whose context
  cannot even hold Table 8), the option whose text is likeliest after the bare question,
  ``argmin_k score_text(image, question, option_k).nll`` (the per-token mean, so that a one-word
  option does not win by being short; the first option on a tie), recorded as that letter;
  GEU stepwise: ``model.edit_image([image], [Tables 10-13])`` (or, with ``edit_prompt="row"``, the
  row's own ``edit_instruction``: the words ShapesWorld's edit rows train), then the question, asked
  of the images ``stepwise_input`` names (below). For ShapesWorld rows with a ``target_scene`` the
  edited image is also checked against it exactly (the stepwise edit accuracy).

**What GEU stepwise answers on** (``stepwise_input``). The paper says only that the task is
"decomposed, with image generation (editing) performed first, followed by visual understanding"
(supplementary B.2): it does not say whether the understanding step still sees the input image. The
public release's stepwise runner (lmms-eval's RealUnify tasks, run with a visual chain-of-thought
model) shows the original image, then the generated one, then the row's evaluation prompt after a
sentence that says so ("In addition to the original image, you are also given a restored version of
the shuffled image ..."). The values:

* ``"original+edited"`` -- that protocol, and the one that reproduces the release:
  ``model.answer_images([[image, edited]], [note + Table 8(question, options)])``
  (:func:`~.prompts.two_image_prompt`; the row's direct question, as the release keeps its evaluation
  prompt). Only ``answer_mode="generate"`` (``score_text`` scores one image per question), and only on
  a model whose ``supports_multi_image`` is True;
* ``"edited"`` -- the edited image alone, ``model.answer([edited], ...)``, in either answer mode. A
  ShapesWorld row asks its ``stepwise_question`` there: the direct question's wording is about the
  board before the edit ("on the original board", "through empty cells"), which a perfect edit
  changes; the stepwise wording asks for the same value of the edited board, so that a perfect edit
  keeps the answer (:mod:`unicon.worlds.shapes_realunify`). A release row asks its one question, and a
  model that needs the original to answer scores lower than with the release's runner;
* ``"auto"`` (the default) -- resolved when the data loads (:func:`resolve_stepwise_input`):
  ``"edited"`` when the GEU rows come from a ShapesWorld root (their stepwise questions are worded for
  the edited image alone), ``"original+edited"`` for the release's rows. ``realunify.json`` records the
  resolved value (``stepwise_input``; null for data without GEU rows).

A GEU stepwise run the model cannot do is refused before any generation (:func:`check_can_run`). A
failed ``generate_image`` / ``edit_image`` batch is retried row by row (:mod:`unicon.evaluation.retry`);
a row that still fails has no image (a failure counted in ``missing_<setting>``).

Each rank evaluates its ``shard_indices`` of the instance list (UEG then GEU), and records and counts
those it owns (:meth:`~unicon.evaluation.category_counts.CategoryCounts.gathered`); rank 0 (or the
merge) writes ``samples.jsonl`` (one :func:`sample_record` per
instance), ``realunify.json`` (``{"metrics", "judge", **info}``, strict JSON: :mod:`unicon.jsonsafe`),
``table.md`` (:func:`~.metrics.markdown_table`), ``settings_by_category.png`` and
``images/<setting>/<category>_<id>.png`` (GEU inputs under ``images/input/``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from PIL import Image

from unicon.config import REALUNIFY_STEPWISE_INPUTS, RealUnifyEvalConfig
from unicon.errors import UserError
from unicon.evaluation import preemption
from unicon.evaluation.distributed import shard_indices, writes_outputs
from unicon.evaluation.framework import eval_mode, write_images, write_results
from unicon.evaluation.realunify.data import GEUInstance, Instance, UEGInstance, check_unique
from unicon.evaluation.realunify.judges import LETTER_PARSERS, PollVerdict, edit_matches, geu_prediction
from unicon.evaluation.realunify.metrics import SETTINGS, RealUnifyMetric, markdown_table
from unicon.evaluation.realunify.plots import plot_results
from unicon.evaluation.realunify.prompts import (
    LETTERS,
    edit_prompt,
    multiple_choice_prompt,
    refine_prompt,
    two_image_prompt,
)
from unicon.evaluation.retry import draw_images, images_by_row
from unicon.models.base import ImageGenerationConfig, UnifiedModel
from unicon.progress import track
from unicon.worlds.shapes import WorldConfig


def check_settings(settings: Sequence[str]) -> list[str]:
    """The settings in :data:`SETTINGS` order; an empty or unknown one is a :class:`UserError`."""
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown or not settings:
        raise UserError(f"--settings {','.join(settings) or '(none)'}: choose one or both of {', '.join(SETTINGS)}")
    return [s for s in SETTINGS if s in settings]


def resolve_stepwise_input(value: str, instances: Sequence[Instance]) -> str | None:
    """``value``, with ``"auto"`` resolved (module docstring): ``"edited"`` when every GEU instance comes
    from a ShapesWorld root, ``"original+edited"`` when any comes from the release's files, None when
    there is no GEU instance. A value outside :data:`~unicon.config.REALUNIFY_STEPWISE_INPUTS` is a
    :class:`UserError` naming the config key and the flag."""
    if value not in REALUNIFY_STEPWISE_INPUTS:
        raise UserError(f"eval.realunify.stepwise_input (--stepwise-input) must be one of "
                        f"{', '.join(REALUNIFY_STEPWISE_INPUTS)}, got {value!r}")
    if value != "auto":
        return value
    geu = [i for i in instances if isinstance(i, GEUInstance)]
    if not geu:
        return None
    return "edited" if all(i.from_world for i in geu) else "original+edited"


def check_can_run(model: UnifiedModel, instances: Sequence[Instance], settings: Sequence[str],
                  stepwise_input: str | None, edit_prompt_source: str = RealUnifyEvalConfig.edit_prompt,
                  answer_mode: str = RealUnifyEvalConfig.answer_mode) -> None:
    """Refuse, before any generation, a GEU stepwise run that cannot happen: a model without image
    editing (``supports_editing`` False), ``edit_prompt="row"`` on rows without ``edit_instruction``,
    and, answering on the original and the edited image (``stepwise_input``, resolved:
    :func:`resolve_stepwise_input`), ``answer_mode="likelihood"`` (one image per scored question) or a
    model that takes one image per question (``supports_multi_image`` False)."""
    geu = [i for i in instances if isinstance(i, GEUInstance)]
    if "stepwise" not in settings or not geu:
        return
    if not getattr(model, "supports_editing", False):
        raise UserError(f"RealUnify GEU stepwise edits the image first, and backend '{model.backend}' does not edit "
                        "images (supports_editing is False); run --settings direct, or a backend that edits")
    if edit_prompt_source == "row":
        bare = [i.source for i in geu if not i.edit_instruction]
        if bare:
            raise UserError(f"--edit-prompt row: {bare[0]} has no 'edit_instruction' ({len(bare)} rows lack it); "
                            "use --edit-prompt paper (Tables 10-13)")
    if stepwise_input != "original+edited":
        return
    if answer_mode != "generate":
        raise UserError(f"--stepwise-input original+edited asks GEU stepwise of two images, and --answer-mode "
                        f"{answer_mode} scores an option after one image; run --answer-mode generate, or "
                        "--stepwise-input edited (the edited image alone)")
    if not getattr(model, "supports_multi_image", False):
        raise UserError(f"--stepwise-input original+edited shows GEU stepwise the input and the edited image, and "
                        f"backend '{model.backend}' takes one image per question (supports_multi_image is "
                        "False); run --stepwise-input edited (the edited image alone), or a backend that takes "
                        "several images")


@dataclass
class Sample:
    """Everything produced for one instance in the settings that ran (an image is ``None`` exactly
    when its error is set). UEG ``images``: the drawn ones; GEU ``images["stepwise"]``: the edited one."""

    instance: Instance
    images: dict[str, Image.Image | None] = field(default_factory=dict)
    errors: dict[str, str | None] = field(default_factory=dict)
    refined: str | None = None
    refined_truncated: bool | None = None
    verdicts: dict[str, PollVerdict] = field(default_factory=dict)  # UEG
    replies: dict[str, str | None] = field(default_factory=dict)  # GEU
    preds: dict[str, str | None] = field(default_factory=dict)  # GEU
    correct: dict[str, bool] = field(default_factory=dict)
    edit_instruction: str | None = None
    edit_match: bool | None = None


def _clean_refined(text: str) -> str:
    text = (text or "").strip()
    for q in ('"', "'", "\u201c\u201d", "`"):
        left, right = q[0], q[-1]
        if len(text) >= 2 and text[0] == left and text[-1] == right:
            text = text[1:-1].strip()
    return text


def _run_ueg(model, batch: list[Sample], settings, max_new_tokens: int, image_config) -> None:
    insts = [s.instance for s in batch]
    if "direct" in settings:
        draw_images(model, batch, "direct", [i.prompt for i in insts], image_config)
    if "stepwise" in settings:
        gens = model.reason([refine_prompt(i.prompt) for i in insts], max_new_tokens=max_new_tokens)
        if len(gens) != len(batch):
            raise RuntimeError(f"reason returned {len(gens)} texts for {len(batch)} prompts")
        for s, g in zip(batch, gens):
            s.refined, s.refined_truncated = _clean_refined(g.text), bool(g.truncated)
        draw_images(model, batch, "stepwise", [s.refined for s in batch], image_config, empty="empty refined prompt")


def answer_choices(model: UnifiedModel, images: list, insts: Sequence[GEUInstance], answer_mode: str,
                   stepwise: bool = False) -> list[str]:
    """One reply per GEU question: generated after Table 8 (``"generate"``), or the letter of the
    likeliest option text (``"likelihood"``; module docstring). ``stepwise``: the questions are asked of
    the edited images, in their ``stepwise_question`` wording where the row has one."""
    questions = [(i.stepwise_question or i.question) if stepwise else i.question for i in insts]
    if answer_mode == "generate":
        return model.answer(images, [multiple_choice_prompt(q, i.options) for q, i in zip(questions, insts)])
    scores = model.score_text(images, questions, [list(i.options) for i in insts])
    return [LETTERS[int(scores.nll[b, :len(inst.options)].argmin())] for b, inst in enumerate(insts)]


def answer_with_original(model: UnifiedModel, originals: list, edited: list,
                         insts: Sequence[GEUInstance]) -> list[str]:
    """``stepwise_input="original+edited"``: one generated reply per GEU question, asked of the input
    image and then the edited one with :func:`~.prompts.two_image_prompt` over the row's question."""
    replies = model.answer_images([[o, e] for o, e in zip(originals, edited)],
                                  [two_image_prompt(i.category, i.question, i.options) for i in insts])
    if len(replies) != len(insts):
        raise RuntimeError(f"answer_images returned {len(replies)} replies for {len(insts)} questions")
    return replies


def _run_geu(model, batch: list[Sample], settings, image_config, edit_prompt_source: str, world_cfg,
             answer_mode: str = RealUnifyEvalConfig.answer_mode,
             letter_parse: str = RealUnifyEvalConfig.letter_parse,
             stepwise_input: str = "edited") -> None:
    insts: list[GEUInstance] = [s.instance for s in batch]  # type: ignore[misc]
    images = [i.image() for i in insts]
    if "direct" in settings:
        replies = answer_choices(model, images, insts, answer_mode)
        for s, reply in zip(batch, replies):
            s.replies["direct"] = reply
            s.errors["direct"] = None
    if "stepwise" in settings:
        for s in batch:
            i = s.instance
            s.edit_instruction = i.edit_instruction if edit_prompt_source == "row" else edit_prompt(i.category, i.question)
        edited, errs = images_by_row(lambda rows: model.edit_image([images[r] for r in rows],
                                                                   [batch[r].edit_instruction for r in rows],
                                                                   config=image_config),
                                     range(len(batch)), "edit_image")
        for s, im, err in zip(batch, edited, errs):
            s.images["stepwise"], s.errors["stepwise"] = im, err
            s.replies["stepwise"] = None
        done = [k for k, im in enumerate(edited) if im is not None]
        if done:
            asked = [insts[k] for k in done]
            if stepwise_input == "original+edited":
                replies = answer_with_original(model, [images[k] for k in done], [edited[k] for k in done], asked)
            else:
                replies = answer_choices(model, [edited[k] for k in done], asked, answer_mode, stepwise=True)
            for k, reply in zip(done, replies):
                batch[k].replies["stepwise"] = reply
        for s in batch:
            if s.instance.target_scene is not None:
                s.edit_match = edit_matches(s.images["stepwise"], s.instance.target_scene, world_cfg or WorldConfig())
    for s in batch:
        for setting in settings:
            s.preds[setting], s.correct[setting] = geu_prediction(s.instance, s.replies.get(setting), letter_parse)


def generate_samples(model: UnifiedModel, instances: Sequence[Instance], settings: Sequence[str],
                     max_new_tokens: int = RealUnifyEvalConfig.max_new_tokens,
                     batch_size: int = RealUnifyEvalConfig.batch_size,
                     image_config: ImageGenerationConfig | None = None,
                     edit_prompt_source: str = RealUnifyEvalConfig.edit_prompt,
                     world_cfg: WorldConfig | None = None,
                     answer_mode: str = RealUnifyEvalConfig.answer_mode,
                     letter_parse: str = RealUnifyEvalConfig.letter_parse,
                     stepwise_input: str | None = "edited") -> list[Sample]:
    """Run the settings for every instance (GEU answers scored; UEG images not yet judged);
    ``stepwise_input`` resolved (:func:`resolve_stepwise_input`)."""
    samples = [Sample(inst) for inst in instances]
    runs = {"ueg": lambda batch: _run_ueg(model, batch, settings, max_new_tokens, image_config),
            "geu": lambda batch: _run_geu(model, batch, settings, image_config, edit_prompt_source, world_cfg,
                                          answer_mode, letter_parse, stepwise_input)}
    for axis, run in runs.items():
        mine = [s for s in samples if s.instance.axis == axis]
        for batch in preemption.batches(mine, batch_size, f"realunify: {axis.upper()} ({', '.join(settings)})"):
            run(batch)
    return samples


def judge_samples(judge, samples: Sequence[Sample], settings: Sequence[str]) -> None:
    """Poll every UEG image of ``settings`` with ``judge``; fill ``verdicts`` and ``correct`` in place."""
    ueg = [s for s in samples if isinstance(s.instance, UEGInstance)]
    if not ueg:
        return
    for setting in track(settings, f"realunify: judging UEG ({judge.name})", unit="settings"):
        verdicts = judge.judge([s.instance for s in ueg], [s.images.get(setting) for s in ueg])
        if len(verdicts) != len(ueg):
            raise RuntimeError(f"judge '{judge.name}' returned {len(verdicts)} verdicts for {len(ueg)} images")
        for s, v in zip(ueg, verdicts):
            s.verdicts[setting] = v
            s.correct[setting] = all(v.correct(s.instance.questions))


# ---------------------------------------------------------------------------------------------
# records and files
# ---------------------------------------------------------------------------------------------
def sample_record(s: Sample, image_paths: dict[str, str | None]) -> dict[str, Any]:
    """One row of ``samples.jsonl``; the metric is computed from these rows. A setting that did not
    run has ``correct_<setting>`` None."""
    inst = s.instance
    rec: dict[str, Any] = {"id": inst.id, "axis": inst.axis, "category": inst.category, "source": inst.source}
    if isinstance(inst, UEGInstance):
        rec.update(prompt=inst.prompt, questions=[{"question": q["question"], "answer": q["answer"]}
                                                  for q in inst.questions],
                   refined_prompt=s.refined, refined_truncated=s.refined_truncated)
    else:
        rec.update(question=inst.question, options=inst.options, answer=inst.answer,
                   image=image_paths.get("input"), edit_instruction=s.edit_instruction, edit_match=s.edit_match)
    for setting in SETTINGS:
        ran = setting in s.correct
        rec[f"image_{setting}"] = image_paths.get(setting)
        rec[f"image_error_{setting}"] = s.errors.get(setting) if ran else None
        if isinstance(inst, UEGInstance):
            v = s.verdicts.get(setting)
            rec[f"statuses_{setting}"] = v.statuses if v else None
            rec[f"judge_replies_{setting}"] = v.replies if v else None
        else:
            rec[f"reply_{setting}"] = s.replies.get(setting)
            rec[f"pred_{setting}"] = s.preds.get(setting)
        rec[f"correct_{setting}"] = s.correct.get(setting)
    return rec


def save_images(out_dir: Path, s: Sample) -> dict[str, str | None]:
    """Save a sample's images as ``images/<setting>/<key>.png`` (a GEU input as ``images/input/``);
    ``{setting or "input": path relative to out_dir}``."""
    shown = dict(s.images)
    if isinstance(s.instance, GEUInstance):
        shown["input"] = s.instance.image()
    return write_images(out_dir, shown, s.instance.key)


TABLE_COLUMNS = ["id", "axis", "category", "text", "direct_image", "direct_output", "direct_correct",
                 "stepwise_image", "stepwise_output", "stepwise_correct"]


def table_rows(samples: Sequence[Sample], limit: int | None = None) -> list[list[Any]]:
    """Rows for :func:`unicon.evaluation.logs.log_table`: per sample, the direct and stepwise
    images side by side (UEG: the two drawings; GEU: the input image the direct answer saw and the
    edited one), with the judge's answers / the model's reply and whether each setting was right."""
    rows = []
    for s in samples[:limit]:
        i = s.instance
        if isinstance(i, UEGInstance):
            text = i.prompt
            outputs = {k: " ".join(s.verdicts[k].statuses) if k in s.verdicts else None for k in SETTINGS}
            if s.refined is not None:
                outputs["stepwise"] = f"refined: {s.refined} | {outputs['stepwise']}"
            images = {k: s.images.get(k) for k in SETTINGS}
        else:
            text = multiple_choice_prompt(i.question, i.options)
            outputs = {k: s.replies.get(k) for k in SETTINGS}
            images = {"direct": i.image() if "direct" in s.correct else None, "stepwise": s.images.get("stepwise")}
        rows.append([str(i.id), i.axis, i.category, text,
                     images["direct"], outputs["direct"], s.correct.get("direct"),
                     images["stepwise"], outputs["stepwise"], s.correct.get("stepwise")])
    return rows


def evaluate_realunify(
    model: UnifiedModel,
    instances: Sequence[Instance],
    judge,
    out_dir: str | Path | None = None,
    settings: Sequence[str] = SETTINGS,
    max_new_tokens: int = RealUnifyEvalConfig.max_new_tokens,
    batch_size: int = RealUnifyEvalConfig.batch_size,
    image_config: ImageGenerationConfig | None = None,
    info: dict | None = None,
    device: torch.device | str = "cpu",
    edit_prompt_source: str = RealUnifyEvalConfig.edit_prompt,
    world_cfg: WorldConfig | None = None,
    check_model: bool = True,
    answer_mode: str = RealUnifyEvalConfig.answer_mode,
    letter_parse: str = RealUnifyEvalConfig.letter_parse,
    stepwise_input: str = RealUnifyEvalConfig.stepwise_input,
) -> tuple[dict[str, float], list[Sample]]:
    """Generate, judge and score ``instances`` on every rank of the process group (or alone, a shard,
    a merge). Returns the metrics (the same on every rank) and this rank's samples.

    Two instances of a category with one id are refused (:func:`~.data.check_unique`): their images
    would overwrite each other. ``stepwise_input`` ``"auto"`` is resolved here
    (:func:`resolve_stepwise_input`) and the resolved value written to ``realunify.json``.
    ``check_model`` False skips :func:`check_can_run` (a merge: the shards checked their model)."""
    if not instances:
        raise UserError("RealUnify: no instances to evaluate")
    check_unique(instances)  # one image file per instance and setting
    settings = check_settings(list(settings))
    if answer_mode not in ("generate", "likelihood"):
        raise UserError(f"eval.realunify.answer_mode must be 'generate' or 'likelihood', got {answer_mode!r}")
    if letter_parse not in LETTER_PARSERS:
        raise UserError(f"eval.realunify.letter_parse must be 'strict' or 'lenient', got {letter_parse!r}")
    stepwise_input = resolve_stepwise_input(stepwise_input, instances)
    if check_model:
        check_can_run(model, instances, settings, stepwise_input, edit_prompt_source, answer_mode)
    mine = shard_indices(len(instances))
    with eval_mode(model):
        samples = generate_samples(model, [instances[i] for i in mine], settings, max_new_tokens, batch_size,
                                   image_config, edit_prompt_source, world_cfg, answer_mode, letter_parse,
                                   stepwise_input)
    judge_samples(judge, samples, settings)

    out = Path(out_dir) if out_dir is not None else None
    metrics, records = RealUnifyMetric.gathered(instances, mine, samples, sample_record, save_images, out, device)
    if out is not None and writes_outputs():
        summary = {"metrics": metrics, "judge": getattr(judge, "name", str(judge)), "settings": settings,
                   "letter_parse": letter_parse, "stepwise_input": stepwise_input, **(info or {})}
        write_results(out, "realunify.json", summary, records, markdown_table(metrics))
        plot_results(metrics, out)
    return metrics, samples
