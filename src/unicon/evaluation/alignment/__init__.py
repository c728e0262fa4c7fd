"""Image-text alignment against human ratings: BagelScore (the BagelScore/EditingScore paper, §3.1) of
any :class:`~unicon.models.base.UnifiedModel`, with the paper's Table 1 baselines (CLIPScore,
RefCLIPScore, BLEU-1, BLEU-4, ROUGE-L, METEOR, CIDEr-D, SPICE, BERTScore) side by side, as Kendall τ_b
and τ_c (docs/alignment.md). The modules are the rooms of every suite (docs/layout.md).
"""
