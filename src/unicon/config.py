"""Typed run configuration, composed from ``configs/`` with OmegaConf.

A run's config is ``RunConfig`` (the schema below) merged, in order, with:

1. ``configs/config.yaml`` -- the base, whose ``defaults:`` picks one file per group;
2. the group files ``configs/<group>/<name>.yaml`` chosen by the defaults, by the
   experiment's own ``defaults:``, or on the command line as ``group=name``;
3. ``configs/experiment/<name>.yaml`` (``experiment=<name>``) -- a small override file;
4. command-line dotlist overrides such as ``trainer.max_epochs=3``.

Groups are ``model data trainer loss eval logger``; a group file holds the body of
that section (``configs/loss/spearman.yaml`` holds ``type: spearman`` ...).

An experiment may extend another with ``extends: <experiment name>``: the parent's ``defaults:``
and body come first, the child's on top (mappings merge key by key, a list or a value is
replaced), and a parent may extend a grandparent. ``shapes_consistency_control`` is
``shapes_consistency`` with ``defaults: {loss: none}`` and its own ``name``.

Every layer is validated against the schema: an unknown key or a wrong type raises
:class:`ConfigError` naming the key and the file (or "command line") it came from. Fields with
a fixed set of values are declared with :func:`choice` and checked right after composition, so a
bad value fails at compose time, before anything is built, naming the file or "command line".

``eval`` holds one section per in-tree evaluation suite (:class:`EvalConfig`'s fields) and, through
:func:`set_eval_sections`, one per out-of-tree suite: the suite registry
(:mod:`unicon.evaluation.suites`) supplies each plugin's eval dataclass, and every composition adds
it to the schema before merging, so ``eval.<plugin>.<key>=...`` is typed and validated alike.

Why hand-written rather than Hydra's compose API: composition is a few functions on OmegaConf, which
is already a dependency, while Hydra is not installed. The composer remembers which file (or
"command line") set every key, so a bad value found by :func:`validate` (from the schema's
``choice``/``bounded`` declarations) is one line naming the key and that file; Hydra would need a
custom error path for it. It applies a command-line ``group=name`` again after the experiment body,
supports ``extends:`` with cycle detection, and composes a resumed run from the config stored in its
checkpoint (:func:`compose_resume`, listing each change), all of which Hydra's defaults lists would
need extra work for; and it keeps no global state (no ``initialize``/``GlobalHydra`` context).
"""

from __future__ import annotations

import importlib.metadata
import math
import os
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, get_type_hints

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

GROUPS = ("model", "data", "trainer", "loss", "eval", "logger")


class ConfigError(ValueError):
    """A user mistake in a config file or override; its message is one readable line."""


#: backends that ``unicon.models`` registers (``@register_backend`` in their modules; a test checks
#: this list against the registry). Installed packages add theirs through the entry-point group.
IN_TREE_BACKENDS = ("ofa", "janus", "decoupled")
BACKEND_ENTRY_POINTS = "unicon.backends"


def backend_names() -> tuple[str, ...]:
    """The allowed ``model.backend`` values: the in-tree backends, then those that installed
    packages declare in the ``unicon.backends`` entry-point group (read from package metadata,
    so composing a config never imports a model)."""
    plugins = sorted({ep.name for ep in importlib.metadata.entry_points(group=BACKEND_ENTRY_POINTS)})
    return IN_TREE_BACKENDS + tuple(name for name in plugins if name not in IN_TREE_BACKENDS)


# ---------------------------------------------------------------------------------------------
# Schema. ``choice(...)`` and ``bounded(...)`` declare the allowed values of a field; they are
# checked by :func:`validate` right after composition, before anything is built.
# ---------------------------------------------------------------------------------------------
def choice(default: Any, allowed: Sequence[str] | Callable[[], Sequence[str]], *, optional: bool = False,
           each: bool = False):
    """A field whose value (or, with ``each``, every list element) must be one of ``allowed``
    (a sequence, or a function returning one when the values are only known at run time)."""
    meta = {"choices": allowed if callable(allowed) else tuple(allowed), "optional": optional, "each": each}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def bounded(default: Any, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
            hi_open: bool = False, extra: Sequence[Any] = ()):
    """A numeric field in ``[lo, hi]`` (``lo_open``/``hi_open`` exclude the end); ``extra`` lists
    special values also allowed (e.g. ``-1`` = unlimited); ``None`` is allowed where the default is."""
    return field(default=default, metadata={"range": (lo, hi, lo_open, hi_open, tuple(extra))})


STRATEGIES = ("auto", "ddp", "ddp_spawn", "fsdp", "deepspeed_zero2", "deepspeed_zero2_offload",
              "deepspeed_zero3", "deepspeed_zero3_offload")
PRECISIONS = ("32-true", "32", "16-mixed", "16", "bf16-mixed", "bf16", "bf16-true", "16-true", "64-true", "64")
MIXTURE_TASKS = ("caption", "vqa", "grounding", "t2i", "reason", "reason_t2i", "edit", "instruct")  # data.tasks
OPTIMIZERS = ("adamw", "muon")  # optim.name (unicon.training.optim.build_optimizer)
EVAL_TASKS = ("vqa", "localization", "t2i")  # CocoCon's evaluation tasks t_i (compared with captioning)
SHAPES_EVAL_TASKS = ("vqa", "caption", "grounding", "t2i", "edit")  # the tasks of `unicon evaluate shapes`
SHAPES_DEFAULT_TASKS = ("vqa", "caption", "grounding", "t2i")  # its default: edit only for models that edit
REALUNIFY_SETTINGS = ("direct", "stepwise")  # the settings of `unicon evaluate realunify`
#: the images GEU stepwise answers on (``eval.realunify.stepwise_input``; "auto" is resolved when the data loads)
REALUNIFY_STEPWISE_INPUTS = ("auto", "original+edited", "edited")
COCOCON_MAX_K = 5  # the largest CocoCon difficulty k reported (samples have at most 5 contrast sets)
DRIFT_CHAINS = ("text-first", "image-first")  # the two chains of `unicon evaluate drift`
# judge weight dtypes: the names of unicon.core.DTYPES, or "auto" (the checkpoint's own)
JUDGE_DTYPES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "auto")
JUDGE_MAX_NEW_TOKENS = 512  # default token budget of a judge's reply
EDITING_EPS = 1e-10  # EditingScore's epsilon in rls^2 + eps (the paper's)


@dataclass
class LoraConfig:
    enabled: bool = False
    r: int = bounded(8, 1)
    alpha: int = bounded(16, 1)
    dropout: float = bounded(0.05, 0.0, 1.0, hi_open=True)
    # module-name suffixes wrapped by PEFT; empty = the backend's default attention+MLP projections
    target_modules: list[str] = field(default_factory=list)
    merge_on_export: bool = True


@dataclass
class ModelConfig:
    backend: str = choice("ofa", lambda: backend_names())
    preset: Optional[str] = None  # named architecture preset of the backend (e.g. "shapes-tiny")
    pretrained: Optional[str] = None  # local directory or hub id for from_pretrained
    arch: dict[str, Any] = field(default_factory=dict)  # overrides of the backend config class
    dtype: str = choice("float32", ("float32", "bfloat16", "float16"))
    gradient_checkpointing: bool = False
    # unpickling (pytorch_model.bin weights, a .ckpt that is not plain tensors) only with consent
    allow_pickle: bool = False
    trust_remote_code: bool = False
    freeze: list[str] = field(default_factory=list)  # parameter-name prefixes kept frozen
    freeze_batchnorm: bool = False  # BatchNorm on running statistics, not trained (exact DDP, small batches)
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class DataConfig:
    root: str = "data/shapes"  # directory written by `unicon build-data shapes`
    contrast_file: Optional[str] = None  # CocoCon-schema JSON; default <root>/cococon_train.json
    images_root: Optional[str] = None
    batch_size: int = bounded(32, 1)  # pretraining-mixture examples per step
    contrast_batch_size: int = bounded(8, 1)  # contrast samples per consistency step
    max_contrast: int = bounded(5, 1)
    num_workers: int = bounded(0, 0)
    image_cache_mb: float = bounded(256.0, 0.0)  # decoded mixture images kept per process (0: decode every time)
    # edit (image editing) rows come from the world's edit_<split>.jsonl; not trained on by default
    tasks: list[str] = choice([t for t in MIXTURE_TASKS if t not in ("edit", "instruct")], MIXTURE_TASKS, each=True)
    # "by_task": every mixture batch holds one task (one encoder/decoder call per step instead of
    # one per task; training.datamodule.TaskGroupedSampler); "mixed": batches mix tasks
    # "auto": by_task under DeepSpeed (ZeRO needs every rank's step to use the same parameters), else mixed
    batching: str = choice("auto", ("auto", "mixed", "by_task"))
    # rows of task t seen per epoch = round(weight_t * #rows_t) (default 1; e.g. {reason: 2.0})
    task_weights: dict[str, float] = field(default_factory=dict)
    # fraction of text-to-image rows (t2i) trained with an empty prompt, drawn per row and step: the
    # unconditional model that classifier-free guidance (image_generation.guidance_scale) contrasts with
    # (ShapesWorld, 0.1: guidance 2-3 gave T2I 0%; docs/notebook/2026-11-27-shapes-consistency-notebook.md)
    t2i_prompt_dropout: float = bounded(0.0, 0.0, 1.0)
    # where mixture rows come from: "shapes" = <root>/mixture_train.jsonl; "coco" = the files below
    # (unicon.data.coco_mixture; configs/data/coco.yaml derives them from the three *_root keys)
    source: str = choice("shapes", ("shapes", "coco"))
    coco_root: Optional[str] = None  # COCO folder (annotations/, train2014/): only the paths below use it
    vqa_root: Optional[str] = None  # VQAv2 folder: only the paths below use it
    refcoco_root: Optional[str] = None  # folder of refcoco/ refcoco+/ refcocog/: only the paths below use it
    coco_images: Optional[str] = None  # the folder COCO's file_name values are relative to
    captions_file: Optional[str] = None  # COCO captions_*.json: caption and t2i rows
    vqa_questions_file: Optional[str] = None  # VQAv2 questions JSON
    vqa_annotations_file: Optional[str] = None  # VQAv2 annotations JSON
    refcoco_files: list[str] = field(default_factory=list)  # refs as JSON/JSONL (a .p pickle: allow_pickle)
    refcoco_instances_file: Optional[str] = None  # COCO instances JSON with the refs' ann_id boxes
    refcoco_split: str = choice("train", ("train", "val", "test", "testA", "testB"))  # the refs trained on (RefCOCO's val/test images are COCO train images)
    allow_pickle: bool = False  # read RefCOCO's released refs(*).p pickles (they can run code)


@dataclass
class TrainerConfig:
    max_epochs: int = bounded(1, 1, extra=(-1,))
    max_steps: int = bounded(-1, 1, extra=(-1,))  # -1 = bounded by max_epochs
    accelerator: str = choice("auto", ("auto", "cpu", "gpu", "cuda", "mps", "tpu"))
    devices: Any = 1
    num_nodes: int = bounded(1, 1)
    strategy: str = choice("auto", STRATEGIES)
    precision: str = choice("32-true", PRECISIONS)
    accumulate_grad_batches: int = bounded(1, 1)
    gradient_clip_val: Optional[float] = bounded(1.0, 0.0, lo_open=True)
    log_every_n_steps: int = bounded(10, 1)
    limit_train_batches: Optional[float] = bounded(None, 0.0, lo_open=True)  # int = batches, float <= 1 = fraction
    deterministic: bool = False
    enable_progress_bar: bool = True
    checkpoint_every_n_steps: Optional[int] = bounded(None, 1)  # also save every N optimizer steps (default: epoch ends)
    cpu_threads: Optional[int] = bounded(None, 1)  # torch intra-op threads (None: torch's default)


@dataclass
class OptimConfig:
    name: str = choice("adamw", OPTIMIZERS)  # unicon.training.optim
    lr: float = bounded(1e-6, 0.0, lo_open=True)
    weight_decay: float = bounded(0.01, 0.0)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_ratio: float = bounded(0.1, 0.0, 1.0)
    scheduler: str = choice("linear", ("linear", "cosine", "constant"))


@dataclass
class LossConfig:
    type: str = choice("spearman", ("spearman", "hinge", "none"))
    lambda_: float = bounded(0.25, 0.0)
    gamma: float = bounded(0.5, 0.0, 1.0)  # probability that a step is a consistency update
    regularization: str = choice("l2", ("l2", "kl"))  # torchsort soft_rank regularization
    regularization_strength: float = bounded(1.0, 0.0, lo_open=True)  # ε, the soft ranks' softness in rank steps
    # the Spearman loss's soft ranks: "torchsort" (the paper's projection) or "sigmoid" (ours: pairwise
    # logistic ranks at temperature ε, a gradient for every misordered pair; losses/consistency.py)
    soft_rank: str = choice("torchsort", ("torchsort", "sigmoid"))
    # the Spearman loss's terms: "all" (Eq. 3: every candidate's soft rank) or "gold" (ours: only the
    # gold candidate's soft rank, the order that C_1 measures; losses/consistency.py)
    rank_terms: str = choice("all", ("all", "gold"))
    # the rank scale: "row" (each row divided by its own std) or "batch" (ours: every row of a task in
    # a loss call divided by the RMS of those rows' stds, no 1/std-growing gradient; losses/consistency.py)
    rank_scale: str = choice("row", ("row", "batch"))
    hinge_margin: float = bounded(0.1, 0.0)
    # "mutual" (Eq. 3: both tasks move), "toward_gold" (ours: where only one task ranks the gold
    # first, only the other one moves) or "toward_gold_strict" (ours: as toward_gold, and an example
    # where neither task ranks the gold first is left out; losses/consistency.py)
    direction: str = choice("mutual", ("mutual", "toward_gold", "toward_gold_strict"))
    tasks: list[str] = choice(list(EVAL_TASKS), EVAL_TASKS, each=True)  # evaluation tasks t_i
    # per evaluation task, a factor on its examples' L_const terms (λ_t = λ · factor; 1 when absent)
    task_lambda: dict[str, float] = field(default_factory=dict)
    # a consistency step's evaluation task: drawn per contrast sample, or once per step for every
    # sample on every rank (the paper's Algorithm 1; needed by DeepSpeed ZeRO); "auto": per_step
    # under DeepSpeed, else per_sample (training.module)
    task_draw: str = choice("auto", ("auto", "per_sample", "per_step"))
    on_nonfinite: str = choice("stop", ("stop", "skip"))


@dataclass
class CocoConEvalConfig:
    enabled: bool = True
    every_n_epochs: int = bounded(1, 1)
    data: Optional[str] = None  # CocoCon-schema JSON; default the world's eval file
    images_root: Optional[str] = None
    max_samples: Optional[int] = bounded(200, 1)
    batch_size: int = bounded(16, 1)
    generative: bool = True  # also compute CIDEr / VQA / loc / T2I accuracies
    table_rows: int = bounded(16, 0)
    skip_missing: bool = False  # skip (and count) samples whose image file is missing
    tasks: list[str] = choice(list(EVAL_TASKS), EVAL_TASKS, each=True)  # compared with captioning
    # samples whose gold answer names one of these words are also reported on their own
    # (cococon/probe/...): the concept of a ShapesWorld --caption-gap world
    probe_words: list[str] = field(default_factory=list)


@dataclass
class DriftEvalConfig:
    enabled: bool = True
    every_n_epochs: int = bounded(1, 1)
    seeds: Optional[str] = None  # seed set file; default the world's drift seeds
    num_chains: int = bounded(8, 1)
    generations: int = bounded(4, 1)
    i2t_prompt: Optional[str] = None
    embedders: list[str] = choice(["scene", "clip", "text"], ("scene", "clip", "text", "dino"), each=True)
    geneval: bool = True
    # GenEval metadata file for MGG; default: the world's geneval_metadata.jsonl (ShapesWorld), else GenEval-R
    # (the long BLIP3-o rewrites, <shared>/data/geneval/geneval_prompt_blip3o_rewritten.jsonl, as the paper)
    geneval_prompts: Optional[str] = None
    # MGG detector score threshold; None: the detector's reference value (owlv2 0.1, mask2former 0.3)
    detector_threshold: Optional[float] = None
    long_prompts: bool = False  # use 'detailed_caption' (BLIP3-o rewrite) as T0
    clip: Optional[str] = "checkpoints/shapes_clip"  # open_clip dir / '<arch>:<weights>' (python -m unicon.embedders.clip)
    dino: Optional[str] = None  # transformers DINO directory (image->image)
    sentence: Optional[str] = None  # sentence-transformers dir; default the bundled all-MiniLM-L6-v2
    batch_size: int = bounded(8, 1)
    strips: int = bounded(2, 0)  # chains shown in the strip plot / W&B table


@dataclass
class UReasonEvalConfig:
    enabled: bool = True
    every_n_epochs: int = bounded(1, 1)
    data: Optional[str] = None  # directory of UReason JSONL files; default the world's prompts
    judge: str = "exact"  # exact | vlm:<path> | ...
    chain_judge: Optional[str] = None  # causal-LM path for the reasoning-chain judge (exact judges chains itself)
    max_samples: Optional[int] = bounded(32, 1)  # round-robin over categories
    max_new_tokens: int = bounded(128, 1)
    batch_size: int = bounded(8, 1)
    table_rows: int = bounded(8, 0)  # samples in the W&B table (three images side by side)


@dataclass
class ShapesEvalConfig:
    # off unless an eval group turns it on (configs/eval/shapes_tasks.yaml), so that run configs stored
    # before this section existed (a resumed checkpoint) keep their epoch-end work
    enabled: bool = False
    every_n_epochs: int = bounded(1, 1)
    data: Optional[str] = None  # ShapesWorld root; default data.root
    split: str = choice("test", ("train", "val", "test"))
    max_samples: int = bounded(16, 1)  # examples per task (the first ones of the split)
    batch_size: int = bounded(32, 1)
    tasks: list[str] = choice(list(SHAPES_DEFAULT_TASKS), SHAPES_EVAL_TASKS, each=True)
    examples: int = bounded(6, 0)  # examples per task in the picture (shapes_eval.png)


@dataclass
class RealUnifyEvalConfig:
    # off unless an eval group turns it on (configs/eval/realunify.yaml), so that run configs stored
    # before this section existed (a resumed checkpoint) keep their epoch-end work
    enabled: bool = False
    every_n_epochs: int = bounded(1, 1)
    data: Optional[str] = None  # ShapesWorld root, GEU .parquet (or a folder of them), UEG .jsonl; default data.root
    judge: str = "exact"  # exact (ShapesWorld) | vlm:<local model directory>
    settings: list[str] = choice(list(REALUNIFY_SETTINGS), REALUNIFY_SETTINGS, each=True)
    # GEU stepwise edit prompt: the paper's Tables 10-13, or the row's own edit_instruction (ShapesWorld)
    edit_prompt: str = choice("paper", ("paper", "row"))
    # GEU answers: "generate" (Table 8's prompt, the reply's letter read per letter_parse: the paper) or
    # "likelihood" (the option text with the lowest mean NLL after the bare question: ours)
    answer_mode: str = choice("generate", ("generate", "likelihood"))
    # GEU reply reading: "strict" (a letter alone or in a short answer phrase; ours) or "lenient" (the first
    # capital A-D anywhere once answer phrases are deleted: the authors' scorer, which reproduces the paper)
    letter_parse: str = choice("strict", ("strict", "lenient"))
    # what GEU stepwise answers on: "original+edited" (the input image, then the edited one, the prompt saying
    # so: the public release's runner), "edited" (the edited image alone), or "auto" (resolved when the data
    # loads: "edited" for ShapesWorld rows, whose stepwise questions are worded about the edited board,
    # "original+edited" for the release's)
    stepwise_input: str = choice("auto", REALUNIFY_STEPWISE_INPUTS)
    max_samples: Optional[int] = bounded(4, 1)  # instances per category (the first ones of each)
    max_new_tokens: int = bounded(64, 1)  # the stepwise UEG prompt refinement (Table 9)
    batch_size: int = bounded(8, 1)
    table_rows: int = bounded(8, 0)  # samples in the W&B table (direct and stepwise images side by side)


ALIGNMENT_BAGEL_MODES = ("expected", "decode")  # BagelScore modes (unicon.evaluation.alignment.bagelscore)
# compared with BagelScore: the baselines of the BagelScore paper's Table 1 (BERTScore with a local
# sentence model, unicon.evaluation.alignment.bertscore)
ALIGNMENT_BASELINES = ("clip_s", "refclip_s", "bleu1", "bleu4", "rouge_l", "meteor", "cider", "spice",
                       "bertscore")


@dataclass
class AlignmentEvalConfig:
    # BagelScore vs human ratings (unicon evaluate alignment); off unless an eval group turns it on
    # (configs/eval/alignment.yaml), so that stored run configs keep their epoch-end work
    enabled: bool = False
    every_n_epochs: int = bounded(1, 1)
    data: Optional[str] = None  # Flickr8K .json, .jsonl pairs or a ShapesWorld root; default data.root
    images: Optional[str] = None  # image folder; default the data file's folder (the world root)
    bagel_modes: list[str] = choice(list(ALIGNMENT_BAGEL_MODES), ALIGNMENT_BAGEL_MODES, each=True)
    baselines: list[str] = choice(list(ALIGNMENT_BASELINES), ALIGNMENT_BASELINES, each=True)
    clip: Optional[str] = None  # open_clip dir / '<arch>:<weights>' for CLIP-S and RefCLIP-S (None: skipped)
    # text before every caption CLIP embeds: hessel ("A photo depicts ", Hessel et al.), none, or auto (none
    # for a ShapesWorld CLIP, trained on bare captions; hessel for any other)
    clip_prefix: str = choice("auto", ("auto", "hessel", "none"))
    # BagelScore's rating scale: cf (the paper's Flickr8K-CF prompt, 0/0.3/0.6/1.0), expert (its 1-4 form for
    # Flickr8K-Expert, ours) or auto (expert for a Flickr8K-Expert file, cf otherwise)
    bagel_scale: str = choice("auto", ("auto", "cf", "expert"))
    judge: Optional[str] = None  # optional VLM judge: vlm:<local model directory>
    rating_min: Optional[float] = None  # ratings outside [rating_min, rating_max] are skipped and counted
    rating_max: Optional[float] = None
    max_samples: Optional[int] = bounded(200, 1)  # pairs (the first ones of the file)
    batch_size: int = bounded(8, 1)
    table_rows: int = bounded(16, 0)  # pairs in the W&B table


@dataclass
class EditingEvalConfig:
    # EditingScore vs edit ratings (unicon evaluate editing); off unless an eval group turns it on
    # (configs/eval/editing.yaml), so that stored run configs keep their epoch-end work
    enabled: bool = False
    every_n_epochs: int = bounded(1, 1)
    data: Optional[str] = None  # Edit-1K-like .jsonl; default <data.root>/editscore/editscore.jsonl
    max_samples: Optional[int] = bounded(120, 1)  # rows (the first ones of the file)
    batch_size: int = bounded(16, 1)
    own_edits: int = bounded(0, 0)  # the model's own edits of the world's first N test edit rows, scored too
    table_rows: int = bounded(16, 0)  # samples in the W&B table


@dataclass
class EvalConfig:
    fail_on_error: bool = False  # an exception inside an epoch-end evaluation kills the run
    cococon: CocoConEvalConfig = field(default_factory=CocoConEvalConfig)
    drift: DriftEvalConfig = field(default_factory=DriftEvalConfig)
    ureason: UReasonEvalConfig = field(default_factory=UReasonEvalConfig)
    shapes: ShapesEvalConfig = field(default_factory=ShapesEvalConfig)
    realunify: RealUnifyEvalConfig = field(default_factory=RealUnifyEvalConfig)
    alignment: AlignmentEvalConfig = field(default_factory=AlignmentEvalConfig)
    editing: EditingEvalConfig = field(default_factory=EditingEvalConfig)


#: ``() -> {section: dataclass}``: eval sections beyond :class:`EvalConfig`'s fields (a plugin suite's),
#: set by the evaluation suite registry (:func:`set_eval_sections`); this module imports no suite
_eval_sections: Callable[[], Mapping[str, type]] | None = None


def set_eval_sections(provider: Callable[[], Mapping[str, type]] | None) -> None:
    """Have every composed config carry, next to :class:`EvalConfig`'s fields, the sections that
    ``provider()`` returns (``{name: dataclass}``, the eval dataclass of each out-of-tree suite): each
    is ``eval.<name>``, typed and validated by its dataclass as an in-tree section is."""
    global _eval_sections
    _eval_sections = provider


def eval_sections() -> dict[str, type]:
    """The extra eval sections (:func:`set_eval_sections`), none of them a field of :class:`EvalConfig`."""
    if _eval_sections is None:
        return {}
    known = {f.name for f in fields(EvalConfig)}
    extra = dict(_eval_sections())
    for name, cls in extra.items():
        if name in known or not is_dataclass(cls):
            raise ConfigError(f"eval section {name!r}: " + ("already a field of EvalConfig" if name in known
                                                            else f"{cls!r} is not a dataclass"))
    return extra


@dataclass
class LoggerConfig:
    type: str = choice("wandb", ("wandb", "csv", "none"))
    project: Optional[str] = None  # default $WANDB_PROJECT or "unicon"
    entity: Optional[str] = None
    # default $WANDB_MODE, else online with an API key, offline without
    mode: Optional[str] = choice(None, ("online", "offline", "disabled"), optional=True)
    tags: list[str] = field(default_factory=list)
    # W&B's run group: runs that belong together (make demo's K and M, a Table 2's runs) in one group
    group: Optional[str] = None
    # W&B artifacts at the end of training: the export (type model) and the evaluation outputs
    log_model: bool = False


@dataclass
class RunConfig:
    name: str = "run"
    seed: int = 0
    output_dir: str = "checkpoints"  # runs write to <output_dir>/<name>/
    init_from: Optional[str] = None  # checkpoint (.ckpt or save_pretrained dir) to start from
    resume: Optional[str] = None  # Lightning .ckpt to resume (its stored config + command-line overrides)
    # resume= a checkpoint older than another one in its folder (going back to its step); one command's
    # choice, never taken over from a checkpoint's stored config
    resume_older: bool = False
    overwrite: bool = False  # start in a non-empty run folder, deleting the old run's files
    experiment: Optional[str] = None
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)


# ---------------------------------------------------------------------------------------------
# Composition
# ---------------------------------------------------------------------------------------------
def config_dir() -> Path:
    """``$UNICON_CONFIG_DIR`` or the repository's ``configs/``."""
    env = os.environ.get("UNICON_CONFIG_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "configs"


def _load_yaml(path: Path) -> DictConfig:
    if not path.is_file():
        options = sorted(p.stem for p in path.parent.glob("*.yaml")) if path.parent.is_dir() else []
        raise ConfigError(f"no config file {path} (available: {', '.join(options) or 'none'})")
    try:
        cfg = OmegaConf.load(path)
    except Exception as e:  # yaml.YAMLError and friends
        raise ConfigError(f"{path}: cannot parse YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return cfg


def _merge(base: DictConfig, layer: DictConfig | dict, source: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, layer)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or ""
        msg = str(e).splitlines()[0]
        raise ConfigError(f"{source}: invalid key '{key}': {msg}") from None


def split_overrides(overrides: list[str]) -> tuple[dict[str, str], list[str]]:
    """Split ``group=name`` choices (and ``experiment=``) from dotlist overrides."""
    sections = {name for name, hint in get_type_hints(RunConfig).items() if is_dataclass(hint)}
    choices, dotlist = {}, []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"command line: override '{item}' is not of the form key=value")
        key, value = item.split("=", 1)
        if key in GROUPS or key == "experiment":
            choices[key] = value
        elif key in sections:
            raise ConfigError(f"command line: '{item}': {key} is a config section without group files; "
                              f"set its keys instead, e.g. {key}.<key>=<value> (groups: {', '.join(GROUPS)})")
        else:
            dotlist.append(item)
    return choices, dotlist


def _leaf_keys(node: Any, prefix: str = "") -> list[str]:
    """Dotted keys of every leaf (and every empty mapping) of a plain/OmegaConf mapping."""
    if isinstance(node, (dict, DictConfig)) and len(node):
        out = []
        for k in node:
            out += _leaf_keys(node[k], f"{prefix}{k}.")
        return out
    return [prefix[:-1]] if prefix else []


class _Composer:
    """Merges layers into a ``RunConfig`` and remembers which layer set each key."""

    def __init__(self):
        self.cfg = OmegaConf.structured(RunConfig)
        self.extra = eval_sections()
        with open_dict(self.cfg.eval):
            for name, cls in self.extra.items():
                self.cfg.eval[name] = OmegaConf.structured(cls)
        self.sources: dict[str, str] = {}

    def add(self, layer: DictConfig | dict, source: str) -> None:
        self.cfg = _merge(self.cfg, layer, source)
        for key in _leaf_keys(OmegaConf.create(layer) if isinstance(layer, dict) else layer):
            self.sources[key] = source

    def finish(self) -> DictConfig:
        try:
            OmegaConf.resolve(self.cfg)
        except OmegaConfBaseException as e:
            raise ConfigError(f"cannot resolve interpolation: {str(e).splitlines()[0]}") from None
        resolve_auto(self.cfg)
        validate(self.cfg, self.sources, self.extra)
        return self.cfg


def uses_deepspeed(cfg: DictConfig) -> bool:
    return str(cfg.trainer.strategy).startswith("deepspeed")


def resolve_auto(cfg: DictConfig) -> None:
    """Replace the ``auto`` values that depend on the strategy: ``data.batching`` (by_task under
    DeepSpeed, else mixed) and ``loss.task_draw`` (per_step under DeepSpeed, else per_sample).

    DeepSpeed ZeRO-2/3 reduce (and ZeRO-3 gathers) parameters from hooks, in the order the backward
    pass reaches them, so every rank's step must touch the same parameters in the same order: one
    mixture task per step on all ranks, and one evaluation task per consistency step."""
    zero = uses_deepspeed(cfg)
    if cfg.data.batching == "auto":
        cfg.data.batching = "by_task" if zero else "mixed"
    if cfg.loss.task_draw == "auto":
        cfg.loss.task_draw = "per_step" if zero else "per_sample"


def _dotlist(dotlist: list[str]) -> DictConfig:
    try:
        return OmegaConf.from_dotlist(dotlist)
    except Exception as e:
        raise ConfigError(f"command line: {str(e).splitlines()[0]}") from None


def _pop_defaults(cfg: DictConfig, path: Path, allowed: Sequence[str] = GROUPS) -> dict[str, str]:
    """The ``defaults:`` mapping (group -> file name) of a config file, removed from ``cfg``."""
    defaults = cfg.pop("defaults", None)
    if defaults is None:
        return {}
    if not isinstance(defaults, DictConfig):
        raise ConfigError(f"{path}: defaults: expected a mapping 'group: name' (e.g. 'loss: spearman'), "
                          f"got {defaults!r}")
    unknown = sorted(set(defaults) - set(allowed))
    if unknown:
        raise ConfigError(f"{path}: unknown config group(s) in defaults: {unknown} "
                          f"(groups: {', '.join(allowed)})")
    return dict(defaults)


def _experiment_chain(configs: Path, name: str) -> list[tuple[Path, DictConfig]]:
    """``configs/experiment/<name>.yaml`` and the experiments it ``extends:``, as ``(path, body)``
    pairs, the root parent first; each body without its ``extends:`` key. An unknown parent or a
    cycle raises :class:`ConfigError` naming the file that extends it."""
    chain: list[tuple[Path, DictConfig]] = []
    names = [name]
    extender: Path | None = None  # the file whose extends: named names[-1]
    while True:
        path = configs / "experiment" / f"{names[-1]}.yaml"
        try:
            body = _load_yaml(path)
        except ConfigError as e:
            if extender is None:
                raise
            raise ConfigError(f"{extender}: extends: {e}") from None
        chain.append((path, body))
        parent = body.pop("extends", None)
        if parent is None:
            return chain[::-1]
        if not isinstance(parent, str) or not parent:
            raise ConfigError(f"{path}: extends: expected the name of one experiment of {path.parent}, "
                              f"got {parent!r}")
        if parent in names:
            raise ConfigError(f"{path}: extends: cycle {' -> '.join([*names, parent])}")
        names.append(parent)
        extender = path


def compose(overrides: list[str] | None = None, configs: Path | None = None) -> DictConfig:
    """Build the validated run config from base + groups + experiment + ``overrides``.

    Precedence, lowest first (a later layer wins for every key it sets):

    1. the schema defaults (``RunConfig``);
    2. one file per group: ``configs/config.yaml``'s ``defaults:``, replaced by the experiment's
       ``defaults:`` (those of the experiments it extends first), replaced by ``group=name`` on the
       command line;
    3. the body of ``configs/config.yaml``;
    4. the body of the experiment file (after those of the experiments it extends, parent first);
    5. the group files chosen on the command line, once more -- so ``eval=none`` after
       ``experiment=X`` turns X's evaluations off: a command-line choice beats the experiment;
    6. ``key.sub=value`` dotlist overrides.
    """
    configs = configs or config_dir()
    choices, dotlist = split_overrides(list(overrides or []))
    base = _load_yaml(configs / "config.yaml")
    defaults = _pop_defaults(base, configs / "config.yaml", allowed=(*GROUPS, "experiment"))

    exp_name = choices.pop("experiment", None) or defaults.pop("experiment", None)
    experiments = _experiment_chain(configs, exp_name) if exp_name else []
    for path, body in experiments:
        defaults.update(_pop_defaults(body, path))
    defaults.update(choices)

    c = _Composer()
    group_layers = {}
    for group in GROUPS:
        name = defaults.get(group)
        if name is None:
            continue
        path = configs / group / f"{name}.yaml"
        try:
            group_layers[group] = (OmegaConf.create({group: _load_yaml(path)}), str(path))
        except ConfigError as e:
            if group not in choices:
                raise
            raise ConfigError(f"command line: {group}={name}: {e}") from None
        c.add(*group_layers[group])
    c.add(base, str(configs / "config.yaml"))
    for path, body in experiments:
        c.add(body, str(path))
    if exp_name:
        c.cfg.experiment = exp_name
    for group in choices:
        c.add(*group_layers[group])
    c.add(_dotlist(dotlist), "command line")
    return c.finish()


def compose_resume(stored: dict, source: str, overrides: list[str] | None = None,
                   configs: Path | None = None, resume: str | None = None) -> tuple[DictConfig, list[str]]:
    """The config of a resumed run: the one stored in its checkpoint (``source`` names it), with
    ``resume`` (the checkpoint's path) set, ``resume_older`` off (it is the choice of one command) and
    command-line ``group=name`` files and dotlist overrides on top. Returns ``(cfg, changes)``, one
    ``"key: old -> new"`` line per value the overrides changed."""
    configs = configs or config_dir()
    choices, dotlist = split_overrides(list(overrides or []))
    if "experiment" in choices:
        raise ConfigError("command line: experiment= cannot be combined with resume= (the resumed run's "
                          "config, experiment included, is stored in its checkpoint)")
    stored = _strip_unknown(stored)
    stored["resume_older"] = False
    if resume is not None:
        stored["resume"] = str(resume)
    c = _Composer()
    c.add(stored, source)
    before = OmegaConf.to_container(c.cfg, resolve=True)
    for group, name in choices.items():
        path = configs / group / f"{name}.yaml"
        c.add(OmegaConf.create({group: _load_yaml(path)}), str(path))
    c.add(_dotlist(dotlist), "command line")
    cfg = c.finish()
    after = OmegaConf.to_container(cfg, resolve=True)
    changes = []
    for key in sorted(set(_leaf_keys(before)) | set(_leaf_keys(after))):
        old, new = OmegaConf.select(OmegaConf.create(before), key), OmegaConf.select(cfg, key)
        if old != new:
            changes.append(f"{key}: {old!r} -> {new!r}")
    return cfg, changes


# keys that older versions wrote into checkpoints and that no longer exist (they were never read)
REMOVED_KEYS = ("data.world", "data.build", "trainer.check_val_every_n_epoch", "loss.label_smoothing")


def _strip_unknown(stored: dict) -> dict:
    stored = OmegaConf.to_container(OmegaConf.create(stored))
    for key in REMOVED_KEYS:
        section, _, leaf = key.partition(".")
        if isinstance(stored.get(section), dict):
            stored[section].pop(leaf, None)
    return stored


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------
def field_problem(f, value: Any) -> tuple[Any, str] | None:
    """What is wrong with ``value`` for the schema field ``f`` (its ``choice``/``bounded``
    metadata): ``(offending value, problem)``, or None when it is allowed. Used by :func:`validate`
    and by the ``unicon evaluate`` flags generated from the eval sections."""
    meta = f.metadata
    if "choices" in meta:
        allowed = meta["choices"]() if callable(meta["choices"]) else meta["choices"]
        values = list(value) if meta["each"] else [value]
        if meta["each"] and not values:
            return [], f"must name at least one of: {', '.join(allowed)}"
        for v in values:
            if v is None and meta["optional"]:
                continue
            if v not in allowed:
                return (v if meta["each"] else value), f"is not one of: {', '.join(allowed)}"
    if "range" in meta and value is not None:
        lo, hi, lo_open, hi_open, extra = meta["range"]
        if value in extra:
            return None
        bad = (not math.isfinite(float(value))
               or (lo is not None and (value <= lo if lo_open else value < lo))
               or (hi is not None and (value >= hi if hi_open else value > hi)))
        if bad:
            left = "(" if lo_open else "["
            right = ")" if hi_open else "]"
            rng = f"{left}{'-inf' if lo is None else lo:g}, {'inf' if hi is None else hi:g}{right}" \
                if lo is not None and hi is not None else (
                f"{'>' if lo_open else '>='} {lo:g}" if lo is not None else f"{'<' if hi_open else '<='} {hi:g}")
            also = f" (or {', '.join(map(str, extra))})" if extra else ""
            return value, f"is out of range: must be {rng}{also}"
    return None


def validate(cfg: DictConfig, sources: dict[str, str] | None = None,
             extra: Mapping[str, type] | None = None) -> None:
    """Check every ``choice``/``bounded`` field of the schema and of the ``extra`` eval sections
    (:func:`eval_sections`); raise :class:`ConfigError` naming the key, the value, what is allowed
    and the file (or "command line") that set it."""
    sources = sources or {}

    def fail(key: str, value: Any, problem: str) -> None:
        where = sources.get(key) or next((src for k, src in sources.items() if k.startswith(key + ".")), None)
        raise ConfigError(f"{where or 'default'}: {key}={value!r} {problem}")

    def walk(schema: type, node: DictConfig, prefix: str) -> None:
        hints = get_type_hints(schema)
        for f in fields(schema):
            key, value = f"{prefix}{f.name}", node[f.name]
            if is_dataclass(hints[f.name]):
                walk(hints[f.name], value, key + ".")
                continue
            problem = field_problem(f, value)
            if problem is not None:
                fail(key, *problem)

    walk(RunConfig, cfg, "")
    for name, cls in (extra or {}).items():
        walk(cls, cfg.eval[name], f"eval.{name}.")
    for key in ("data.tasks", "loss.tasks", "eval.cococon.tasks", "eval.drift.embedders",
                "eval.shapes.tasks", "eval.realunify.settings", "eval.alignment.bagel_modes",
                "eval.alignment.baselines"):
        items = list(OmegaConf.select(cfg, key))
        if len(set(items)) != len(items):
            fail(key, items, "lists a value twice")
    for task, weight in dict(cfg.data.task_weights).items():
        if task not in MIXTURE_TASKS:
            fail(f"data.task_weights.{task}", weight, f"names no mixture task: use one of {', '.join(MIXTURE_TASKS)}")
        if not isinstance(weight, (int, float)) or not math.isfinite(float(weight)) or weight < 0:
            fail(f"data.task_weights.{task}", weight, "must be a number >= 0")
    for task, factor in dict(cfg.loss.task_lambda).items():
        if task not in EVAL_TASKS:
            fail(f"loss.task_lambda.{task}", factor, f"names no evaluation task: use one of {', '.join(EVAL_TASKS)}")
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not math.isfinite(float(factor)) or factor < 0:
            fail(f"loss.task_lambda.{task}", factor, "must be a number >= 0")
    betas = list(cfg.optim.betas)
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        fail("optim.betas", betas, "must be two numbers in [0, 1)")
    if cfg.trainer.accelerator == "cpu" and str(cfg.trainer.precision) in ("16-mixed", "16"):
        fail("trainer.precision", cfg.trainer.precision, "is fp16 autocast, which needs CUDA (on CPU Lightning would "
             "run bf16-mixed instead); use trainer.precision=bf16-mixed")
    if uses_deepspeed(cfg) and cfg.data.batching != "by_task":
        fail("data.batching", cfg.data.batching, f"mixes tasks across ranks, and DeepSpeed ({cfg.trainer.strategy}) "
             "needs every rank's step to use the same parameters; use data.batching=by_task (or auto)")
    if uses_deepspeed(cfg) and cfg.loss.task_draw != "per_step":
        fail("loss.task_draw", cfg.loss.task_draw, f"draws tasks per sample, and DeepSpeed ({cfg.trainer.strategy}) "
             "needs every rank's step to use the same parameters; use loss.task_draw=per_step (or auto)")
    if cfg.optim.name != "adamw" and uses_deepspeed(cfg):
        fail("optim.name", cfg.optim.name, f"DeepSpeed ({cfg.trainer.strategy}) partitions an AdamW optimizer "
             "only; use optim.name=adamw, or trainer.strategy=ddp")
    if cfg.optim.name == "muon" and str(cfg.trainer.strategy) == "fsdp":
        fail("optim.name", cfg.optim.name, "FSDP shards every matrix across ranks, and Muon orthogonalises whole "
             "matrices; use optim.name=adamw, or trainer.strategy=ddp")
    if cfg.resume_older and not cfg.resume:
        fail("resume_older", cfg.resume_older, "applies only to a resume: add resume=<ckpt>")
    lim = cfg.trainer.limit_train_batches
    if lim is not None and lim > 1 and float(lim) != int(lim):
        fail("trainer.limit_train_batches", lim, "must be a fraction in (0, 1] or a whole number of batches")


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


def from_container(data: dict, source: str = "checkpoint config") -> DictConfig:
    """Re-validate a plain dict (e.g. the config stored in a checkpoint) against the schema."""
    c = _Composer()
    c.add(_strip_unknown(data), source)
    return c.finish()
