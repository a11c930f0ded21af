"""Text conditioning: a local text encoder, or the deterministic embedder of the built-in default.

The built-in default has no real text encoder (no weights may be downloaded), so it uses
:class:`DeterministicTextEmbedder`: each lower-cased word maps to a fixed pseudo-random vector
derived from a hash of the word. Equal captions give equal embeddings across runs and machines;
different words give different vectors, which is all a demo LoRA on a random-init model needs.
It is NOT a language model and carries no meaning.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import torch

from ..families.base import TextBatch, TextSpec

_WORD = re.compile(r"[\w']+")


class DeterministicTextEmbedder:
    """Captions -> :class:`TextBatch` without a model (the built-in default; see module docstring).

    Args:
        spec: the family's text shapes: per-token width D, pooled width P, length L.
        seed: mixes into every word's vector.

    Call it with a list of B captions; returns ``seq (B, L, D)``, ``mask (B, L)`` and
    ``pooled (B, P)`` (the mean of the real tokens' vectors through a fixed random projection).
    An empty caption is one ``<empty>`` token.
    """

    def __init__(self, spec: TextSpec, seed: int = 0):
        self.spec, self.seed = spec, seed
        g = torch.Generator().manual_seed(seed)
        self._pool = (torch.randn(spec.seq_dim, spec.pooled_dim, generator=g) / spec.seq_dim ** 0.5
                      if spec.pooled_dim else None)

    def word_vector(self, word: str) -> torch.Tensor:
        """The fixed vector of ``word``, ``(D,)``, unit variance."""
        digest = hashlib.blake2b(f"{self.seed}:{word}".encode(), digest_size=8).digest()
        g = torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
        return torch.randn(self.spec.seq_dim, generator=g)

    def __call__(self, captions: list[str]) -> TextBatch:
        length = self.spec.max_length
        seq = torch.zeros(len(captions), length, self.spec.seq_dim)
        mask = torch.zeros(len(captions), length, dtype=torch.bool)
        for i, caption in enumerate(captions):
            words = _WORD.findall(caption.lower())[:length] or ["<empty>"]
            for j, word in enumerate(words):
                seq[i, j] = self.word_vector(word)
            mask[i, : len(words)] = True
        pooled = None
        if self._pool is not None:
            mean = (seq * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
            pooled = mean @ self._pool
        return TextBatch(seq, mask, pooled)


class HFTextEncoder:
    """Captions -> :class:`TextBatch` with a transformers text encoder loaded from a local folder.

    ``seq`` is the encoder's last hidden state ``(B, L, H)``; ``pooled`` is the model's pooled
    output when it has one, else the masked mean of ``seq``.

    Raises:
        ValueError: the encoder's width does not match the family's text shapes.
    """

    def __init__(self, tokenizer, model, spec: TextSpec):
        self.tokenizer, self.model, self.spec = tokenizer, model.eval().requires_grad_(False), spec
        width = model.config.hidden_size
        if width != spec.seq_dim:
            raise ValueError(f"text encoder hidden size {width} does not match the model's text "
                             f"width {spec.seq_dim}")

    @torch.no_grad()
    def __call__(self, captions: list[str]) -> TextBatch:
        tokens = self.tokenizer(captions, padding="max_length", truncation=True,
                                max_length=self.spec.max_length, return_tensors="pt")
        out = self.model(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"])
        seq = out.last_hidden_state.float()
        mask = tokens["attention_mask"].bool()
        pooled = getattr(out, "pooler_output", None)
        if self.spec.pooled_dim:
            if pooled is None:
                pooled = (seq * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
            if pooled.shape[-1] != self.spec.pooled_dim:
                raise ValueError(f"text encoder pooled width {pooled.shape[-1]} does not match the "
                                 f"model's pooled width {self.spec.pooled_dim}")
            pooled = pooled.float()
        else:
            pooled = None
        return TextBatch(seq, mask, pooled)


def load_text_encoder(folder: str | Path, spec: TextSpec) -> HFTextEncoder:
    """Load a transformers text encoder (and its tokenizer) from a local folder, offline.

    The tokenizer is read from ``folder`` or a sibling ``tokenizer/`` folder. T5 models load as
    ``T5EncoderModel``; other models through ``AutoModel``. Only ``.safetensors`` weights are used.

    Raises:
        ValueError: the folder is missing, or widths do not match.
    """
    from transformers import AutoConfig, AutoModel, AutoTokenizer, T5EncoderModel

    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"text encoder path {str(folder)!r} is not a folder")
    tok_dir = folder.parent / "tokenizer" if (folder.parent / "tokenizer").is_dir() else folder
    tokenizer = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    cls = T5EncoderModel if config.model_type in ("t5", "umt5") else AutoModel
    model = cls.from_pretrained(folder, local_files_only=True, use_safetensors=True)
    return HFTextEncoder(tokenizer, model, spec)
