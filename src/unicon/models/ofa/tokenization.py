"""OFA's unified vocabulary: text BPE, then image codes, then location bins.

OFA feeds one decoder with three kinds of token, all in one embedding table::

    [0, n_text)                         text BPE (BART byte-level BPE for OFA-Sys checkpoints;
                                        the world's ``tokenizer.json`` for ShapesWorld)
    [n_text, n_text + num_codes)        <code_0> ... <code_{num_codes-1}>   (VQ image tokens)
    [n_text + num_codes, ... + num_bins) <bin_0> ... <bin_{num_bins-1}>     (quantised coordinates)

The order (codes first, then bins, both appended after the full BPE vocabulary
including ``<mask>``) is the one of the OFA-Sys tokenizer, so that ids match real
checkpoints: with BART's 50,265 entries, ``<code_0>`` is 50265, ``<bin_0>`` is 58457
and the vocabulary has 59,457 entries.

Special ids follow OFA/BART: ``<s>``=0 (bos, also the decoder start), ``<pad>``=1,
``</s>``=2 (eos), ``<unk>``=3.

Boxes are quantised like OFA's grounding data: each coordinate of the *corner*
box ``(x0, y0, x1, y1)`` is divided by the image side and mapped to
``round(v * (num_bins - 1))``; the inverse is ``bin / (num_bins - 1) * side``.
The rest of unicon uses ``[x, y, w, h]`` boxes, converted here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch
from tokenizers import Tokenizer

from unicon.data.jsonl import read_json
from unicon.errors import UserError

BOS_ID, PAD_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
SPECIAL_TOKENS = {"<s>": BOS_ID, "<pad>": PAD_ID, "</s>": EOS_ID, "<unk>": UNK_ID}
CONFIG_NAME = "ofa_tokenizer.json"
BPE_NAME = "tokenizer.json"


class OFATokenizer:
    """Text BPE plus ``num_codes`` image-code and ``num_bins`` location tokens.

    Args:
        text_tokenizer: a ``tokenizers.Tokenizer`` whose special tokens ``<s> <pad> </s> <unk>``
            have ids 0, 1, 2, 3.
        num_codes: size of the image-code block (8192 for OFA's VQGAN, the
            ShapesTokenizer's codebook size for ShapesWorld).
        num_bins: number of location bins (1000 in OFA).
        max_length: longest token sequence (bos/eos included) fed to the model.
    """

    def __init__(self, text_tokenizer: Tokenizer, num_codes: int, num_bins: int, max_length: int = 128):
        for tok, want in SPECIAL_TOKENS.items():
            got = text_tokenizer.token_to_id(tok)
            if got != want:
                raise ValueError(f"text tokenizer must map {tok!r} to id {want} (OFA convention), got {got}")
        if num_codes < 0 or num_bins < 2:
            raise ValueError(f"need num_codes >= 0 and num_bins >= 2, got {num_codes}, {num_bins}")
        self.text = text_tokenizer
        self.num_text = text_tokenizer.get_vocab_size(with_added_tokens=True)
        self.num_codes = num_codes
        self.num_bins = num_bins
        self.max_length = max_length
        self.code_offset = self.num_text
        self.bin_offset = self.num_text + num_codes

    # ---- construction / persistence ------------------------------------------------------
    @classmethod
    def from_file(cls, tokenizer_json: str | Path, num_codes: int, num_bins: int, max_length: int = 128):
        """From a ``tokenizers`` JSON file (the ShapesWorld world's ``tokenizer.json``)."""
        path = Path(tokenizer_json)
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer file {path}")
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises a bare Exception for a malformed file
            raise UserError(f"{path}: not a readable tokenizers JSON file ({str(e).splitlines()[0]}); "
                            "truncated or corrupt?") from None
        return cls(tokenizer, num_codes, num_bins, max_length)

    @classmethod
    def from_bart_files(
        cls, vocab_json: str | Path, merges_txt: str | Path, num_codes: int = 8192, num_bins: int = 1000,
        max_length: int = 1024,
    ):
        """From BART's byte-level BPE files, as shipped with OFA-Sys checkpoints."""
        from tokenizers import ByteLevelBPETokenizer

        for p in (vocab_json, merges_txt):
            if not Path(p).is_file():
                raise FileNotFoundError(f"no BPE file {p}")
        bpe = ByteLevelBPETokenizer.from_file(str(vocab_json), str(merges_txt))
        # BART's vocab.json already holds these at 0..3 and <mask> last; registering them as
        # special keeps their ids and stops the BPE from splitting them.
        bpe.add_special_tokens(list(SPECIAL_TOKENS) + ["<mask>"])
        return cls(bpe._tokenizer, num_codes, num_bins, max_length)

    @classmethod
    def byte_level(cls, vocab_size: int, num_codes: int = 0, max_length: int = 128) -> "OFATokenizer":
        """A merge-free byte-level vocabulary (4 specials + 256 bytes) filling ``vocab_size`` with bins.

        For checkpoints that ship no BPE files, such as the random-weight OFA reference fixture
        (``vocab_size`` 1000): text is spelled byte by byte and the rest of the table is
        ``num_codes`` codes then ``vocab_size - 260 - num_codes`` location bins.
        """
        from tokenizers import decoders, models, pre_tokenizers

        alphabet = pre_tokenizers.ByteLevel.alphabet()
        vocab = {**SPECIAL_TOKENS, **{ch: 4 + i for i, ch in enumerate(sorted(alphabet))}}
        bpe = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        bpe.add_special_tokens(list(SPECIAL_TOKENS))
        num_bins = vocab_size - len(vocab) - num_codes
        if num_bins < 2:
            raise ValueError(f"vocab_size {vocab_size} leaves no room for location bins after "
                             f"{len(vocab)} byte tokens and {num_codes} codes")
        return cls(bpe, num_codes, num_bins, max_length)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "OFATokenizer":
        """Load what :meth:`save_pretrained` wrote, or BART's ``vocab.json`` + ``merges.txt``."""
        path = Path(path)
        cfg_file = path / CONFIG_NAME
        cfg = read_json(cfg_file, what="tokenizer config") if cfg_file.is_file() else {}
        if (path / BPE_NAME).is_file():
            return cls.from_file(path / BPE_NAME, cfg.get("num_codes", 8192), cfg.get("num_bins", 1000),
                                 cfg.get("max_length", 1024))
        if (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
            return cls.from_bart_files(path / "vocab.json", path / "merges.txt", cfg.get("num_codes", 8192),
                                       cfg.get("num_bins", 1000), cfg.get("max_length", 1024))
        raise FileNotFoundError(f"{path}: no {BPE_NAME} and no vocab.json + merges.txt")

    def save_pretrained(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.text.save(str(path / BPE_NAME))
        cfg = {"num_codes": self.num_codes, "num_bins": self.num_bins, "max_length": self.max_length,
               "num_text_tokens": self.num_text}
        (path / CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n")

    def __len__(self) -> int:
        return self.num_text + self.num_codes + self.num_bins

    # ---- text ------------------------------------------------------------------------
    def encode_text(self, text: str, max_length: int | None = None) -> tuple[list[int], bool]:
        """``<s> bpe(text) </s>``; returns (ids, truncated). Over-long text keeps its eos."""
        if not isinstance(text, str):
            raise ValueError(f"expected a string, got {type(text).__name__}: {text!r}")
        body = self.text.encode(text, add_special_tokens=False).ids
        limit = (max_length or self.max_length) - 2
        truncated = len(body) > limit
        return [BOS_ID] + body[:limit] + [EOS_ID], truncated

    def encode_target(self, text: str, max_length: int | None = None) -> tuple[list[int], bool]:
        """Decoder target ``bpe(text) </s>`` (no bos: the decoder input is bos + target[:-1])."""
        ids, truncated = self.encode_text(text, None if max_length is None else max_length + 1)
        return ids[1:], truncated

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """Text of the BPE ids up to the first eos; codes, bins and specials are dropped."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        out = []
        for i in ids:
            if i == EOS_ID:
                break
            if i in (BOS_ID, PAD_ID) or i >= self.num_text:
                continue
            out.append(i)
        return self.text.decode(out, skip_special_tokens=True).strip()

    # ---- image codes -------------------------------------------------------------------
    def codes_to_ids(self, codes: torch.Tensor) -> torch.Tensor:
        """Image code indices (any shape) -> vocabulary ids."""
        if codes.numel() and (codes.min() < 0 or codes.max() >= self.num_codes):
            raise ValueError(f"image codes must lie in [0, {self.num_codes}), got [{codes.min()}, {codes.max()}]")
        return codes.long() + self.code_offset

    def ids_to_codes(self, ids: torch.Tensor) -> torch.Tensor:
        codes = ids.long() - self.code_offset
        if codes.numel() and (codes.min() < 0 or codes.max() >= self.num_codes):
            raise ValueError("ids outside the image-code block")
        return codes

    # ---- location bins -----------------------------------------------------------------
    def box_to_bins(self, box: Sequence[float], width: float, height: float) -> list[int]:
        """``[x, y, w, h]`` pixels -> 4 bin indices of the corners ``(x0, y0, x1, y1)``."""
        if len(box) != 4:
            raise ValueError(f"a box is [x, y, w, h], got {list(box)}")
        x, y, w, h = (float(v) for v in box)
        if w < 0 or h < 0:
            raise ValueError(f"box {list(box)} has a negative width or height")
        n = self.num_bins - 1
        corners = (x / width, y / height, (x + w) / width, (y + h) / height)
        return [int(round(min(max(v, 0.0), 1.0) * n)) for v in corners]

    def bins_to_box(self, bins: Sequence[int], width: float, height: float) -> list[float]:
        """Inverse of :meth:`box_to_bins` (up to quantisation); corners are sorted first."""
        n = self.num_bins - 1
        x0, y0, x1, y1 = (float(b) / n for b in bins)
        x0, x1 = sorted((x0, x1))
        y0, y1 = sorted((y0, y1))
        return [x0 * width, y0 * height, (x1 - x0) * width, (y1 - y0) * height]

    def box_to_ids(self, box: Sequence[float], width: float, height: float) -> list[int]:
        return [b + self.bin_offset for b in self.box_to_bins(box, width, height)]

    def ids_to_box(self, ids: Sequence[int] | torch.Tensor, width: float, height: float) -> list[float]:
        bins = [int(i) - self.bin_offset for i in (ids.tolist() if isinstance(ids, torch.Tensor) else ids)]
        if any(b < 0 or b >= self.num_bins for b in bins):
            raise ValueError(f"ids {list(ids)} are not all location bins")
        return self.bins_to_box(bins, width, height)
