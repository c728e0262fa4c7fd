"""A finished run's export, ``<run_dir>/export``: ``save_pretrained`` of the trained model (LoRA
merged per ``model.lora.merge_on_export``), written by global rank 0; a DeepSpeed run's model is
the one its last checkpoint folder holds (:func:`deepspeed_trained_model`)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf


def export_run(trainer, module, last_checkpoint: str, run_dir: Path, cfg: DictConfig) -> Path:
    """Write ``<run_dir>/export``, the export of a run that ``trainer`` has fitted (on global rank 0
    only); returns its path."""
    from unicon.models.checkpoints import export_model  # lazy: pulls in every model backend (transformers)

    export_dir = run_dir / "export"
    if not trainer.is_global_zero:
        return export_dir
    model, run_config = module.model, cfg
    deepspeed = str(cfg.trainer.strategy).startswith("deepspeed")
    if deepspeed:
        model, run_config = deepspeed_trained_model(last_checkpoint, trainer.global_step, cfg)
    export_model(model, export_dir, merge=cfg.model.lora.merge_on_export,
                 run_config=OmegaConf.to_container(run_config, resolve=True))
    if deepspeed:
        print(f"export: {export_dir} (converted from the DeepSpeed checkpoint {last_checkpoint})")
    return export_dir


def deepspeed_trained_model(last_checkpoint: str, global_step: int, cfg: DictConfig):
    """``(model, run config)`` of a DeepSpeed run, from its last checkpoint folder (written by every
    rank at the final step): Lightning's ``convert_zero_checkpoint_to_fp32_state_dict`` gathers the
    fp32 master weights from all ZeRO-2/3 partitions
    (:func:`unicon.models.checkpoints.read_deepspeed_checkpoint`). Under ZeRO-3 no rank holds the
    whole model in memory, and under mixed precision the fp32 master weights are the trained ones,
    so the checkpoint is the source for both stages."""
    # lazy: pulls in every model backend (transformers), not needed by unicon train --help
    from unicon.models.checkpoints import deepspeed_client_state, load_lightning_checkpoint

    if not last_checkpoint:
        raise RuntimeError("DeepSpeed run: no checkpoint was written, nothing to export from")
    allow_pickle = bool(cfg.model.allow_pickle)
    saved = int(deepspeed_client_state(last_checkpoint, allow_pickle)["global_step"])
    if saved != global_step:
        raise RuntimeError(f"DeepSpeed run: the last checkpoint {last_checkpoint} is at step {saved}, the run ended at "
                           f"step {global_step}; export it with unicon.models.checkpoints.export_checkpoint")
    return load_lightning_checkpoint(last_checkpoint, allow_pickle=allow_pickle)
