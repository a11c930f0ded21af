"""Text conditioning: the local text encoders a family's pipeline uses, or the stand-in embedder.

A family declares its pipeline's encoders (:class:`~..families.conditioning.TextEncoders`: Flux
CLIP-L + T5, SD3 CLIP-L + CLIP-G + T5, Qwen-Image Qwen2.5-VL, ...). Folders are identified by their
``config.json`` ``model_type`` and loaded with ``local_files_only=True`` (never downloaded).

Without encoders (the built-in default: no weights may be downloaded) captions go through
:class:`DeterministicTextEmbedder`: each lower-cased word maps to a fixed pseudo-random vector
derived from a hash of the word. Equal captions give equal embeddings across runs and machines;
different words give different vectors, which is all a demo LoRA on a random-init model needs.
It is NOT a language model and carries no meaning: a run that uses it says so loudly
(:func:`stand_in_warning`, and ``report.json`` ``text_encoder``).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from ..families import FamilyAdapter, TextBatch, TextSpec
from ..families.conditioning import TextEncoders
from ..families.lazy import lazy_imports

_WORD = re.compile(r"[\w']+")
_KINDS = {"t5": "t5", "umt5": "t5", "mt5": "t5", "clip_text_model": "clip"}
"""``config.json`` ``model_type`` -> encoder kind; other model types are their own kind."""
_NAMES = {"t5": "T5", "clip": "CLIP", "qwen2_5_vl": "Qwen2.5-VL", "gemma2": "Gemma 2"}
_CLIP_TOKENS = 77  # CLIP's context length (the pipelines' tokenizer_max_length)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "spiece.model", "vocab.json", "tokenizer.model")


class TextEncoderError(ValueError):
    """Text encoder folders that cannot serve the family; the message names them and what it needs."""


class TextEncoderWarning(UserWarning):
    """Captions are not encoded by a language model (the stand-in embedder is used)."""


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

    def overflow(self, captions: list[str]) -> list[str | None]:
        """Per caption, how the embedder cuts it (``stand-in embedder: 80 words, reads 64``), or None."""
        length = self.spec.max_length
        counts = [len(_WORD.findall(c.lower())) for c in captions]
        return [f"stand-in embedder: {n} words, reads {length}" if n > length else None for n in counts]

    def describe(self) -> dict[str, Any]:
        """``report.json`` ``text_encoder``."""
        return {"kind": "stand-in", "what": "deterministic word embedder: NOT a language model", "seed": self.seed}


def encoder_kind(folder: str | Path) -> str:
    """The kind of the transformers encoder in ``folder`` (``t5``, ``clip``, ``qwen2_5_vl``, ...),
    from its ``config.json`` ``model_type``.

    Raises:
        TextEncoderError: no folder, no readable ``config.json``, or no ``model_type``.
    """
    config = Path(folder) / "config.json"
    try:
        model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError) as exc:
        raise TextEncoderError(f"text encoder {str(folder)!r} has no readable config.json: {exc}") from exc
    if not isinstance(model_type, str) or not model_type:
        raise TextEncoderError(f"text encoder {str(folder)!r}: config.json names no model_type")
    return _KINDS.get(model_type, model_type)


def _tokenizer_folder(folder: Path) -> Path:
    """``folder`` when it holds a tokenizer, else the pipeline sibling (``text_encoder_2`` ->
    ``tokenizer_2``), else a sibling ``tokenizer``."""
    if any((folder / name).is_file() for name in _TOKENIZER_FILES):
        return folder
    suffix = folder.name.removeprefix("text_encoder") if folder.name.startswith("text_encoder") else ""
    for candidate in (folder.parent / f"tokenizer{suffix}", folder.parent / "tokenizer"):
        if candidate.is_dir():
            return candidate
    raise TextEncoderError(f"text encoder {str(folder)!r} has no tokenizer (in the folder or a sibling tokenizer/)")


class _Encoder:
    """One local encoder: its kind, tokenizer and model (eval, frozen)."""

    def __init__(self, folder: Path):
        """Load the encoder in ``folder`` offline.

        Raises:
            TextEncoderError: no tokenizer, or the model or tokenizer cannot be loaded.
        """
        with lazy_imports():
            from transformers import (
                AutoConfig,
                AutoModel,
                AutoTokenizer,
                CLIPTextModel,
                CLIPTextModelWithProjection,
                MT5EncoderModel,
                T5EncoderModel,
                UMT5EncoderModel,
            )

        self.folder, self.kind = folder, encoder_kind(folder)
        tokenizer_folder = _tokenizer_folder(folder)
        try:
            config = AutoConfig.from_pretrained(folder, local_files_only=True)
            classes = {"t5": T5EncoderModel, "umt5": UMT5EncoderModel, "mt5": MT5EncoderModel}
            cls = classes.get(config.model_type, AutoModel)
            if self.kind == "clip":
                projected = "CLIPTextModelWithProjection" in (getattr(config, "architectures", None) or [])
                cls = CLIPTextModelWithProjection if projected else CLIPTextModel
            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder, local_files_only=True)
            model = cls.from_pretrained(folder, local_files_only=True, use_safetensors=True)
        except (OSError, ValueError, KeyError) as exc:  # no .safetensors weights, an unknown model type
            raise TextEncoderError(f"text encoder {str(folder)!r} could not be loaded ({self.kind}): {exc}") from exc
        self.model = model.eval().requires_grad_(False)

    def overflow(self, texts: list[str], max_length: int) -> list[str | None]:
        """Per text, how :meth:`run` at ``max_length`` cuts it (``T5: 600 tokens, reads 512``), or
        None; the tokenizer's own count (special tokens included, nothing truncated)."""
        ids = self.tokenizer(texts, truncation=False, verbose=False)["input_ids"]
        name = _NAMES.get(self.kind, self.kind)
        return [f"{name}: {len(i)} tokens, reads {max_length}" if len(i) > max_length else None for i in ids]

    def run(self, texts: list[str], max_length: int, padding: str = "max_length") -> tuple[Any, torch.Tensor]:
        """``(model output with hidden_states, mask (B, L) bool)``."""
        tokens = self.tokenizer(texts, padding=padding, truncation=True, max_length=max_length, return_tensors="pt")
        out = self.model(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"],
                         output_hidden_states=True)
        return out, tokens["attention_mask"].bool()


class TextEncoderSet:
    """Captions -> :class:`TextBatch` with the encoders of a family's pipeline (its
    :class:`~..families.conditioning.TextEncoders`): ``seq (B, L, D)`` from the seq encoder's
    hidden state, ``pooled (B, P)`` from the CLIPs, SD3's CLIP states before the T5 tokens.

    Raises:
        TextEncoderError: (when called) the widths do not match the model's text shapes.
    """

    def __init__(self, family: str, recipe: TextEncoders, spec: TextSpec, clips: list[_Encoder], seq: _Encoder):
        self.family, self.recipe, self.spec, self.clips, self.seq = family, recipe, spec, clips, seq

    @torch.no_grad()
    def __call__(self, captions: list[str]) -> TextBatch:
        r = self.recipe
        seq, mask = self._sequence(captions)
        clip_out = [clip.run(captions, min(_CLIP_TOKENS, clip.tokenizer.model_max_length))[0] for clip in self.clips]
        if r.clip_states:  # SD3: (B, 77, H_l + H_g) padded to the T5 width, then the T5 tokens
            states = torch.cat([out.hidden_states[-2].float() for out in clip_out], dim=-1)
            states = F.pad(states, (0, seq.shape[-1] - states.shape[-1]))
            seq, mask = torch.cat([states, seq], dim=1), torch.ones(seq.shape[0], states.shape[1] + seq.shape[1],
                                                                    dtype=torch.bool)
        pooled = None
        if r.pooled:
            pooled = torch.cat([_clip_pooled(out).float() for out in clip_out], dim=-1)
        self._check(seq, pooled)
        return TextBatch(seq, mask, pooled)

    def overflow(self, captions: list[str]) -> list[str | None]:
        """Per caption, how the first encoder that cuts it does (the seq encoder at its length, its
        template's tokens included; each CLIP at 77 tokens), or None."""
        r = self.recipe
        found = [self.seq.overflow([r.template.format(c) for c in captions], r.max_length + r.drop)]
        found += [clip.overflow(captions, min(_CLIP_TOKENS, clip.tokenizer.model_max_length)) for clip in self.clips]
        return [next((why for why in whys if why), None) for whys in zip(*found)]

    def _sequence(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """The seq encoder's states ``(B, L, D)`` and mask; with a template, its first ``drop``
        tokens removed from each prompt and the rest re-padded to the longest (as Qwen-Image)."""
        r = self.recipe
        if not r.drop:
            out, mask = self.seq.run([r.template.format(c) for c in captions], r.max_length)
            return out.hidden_states[r.hidden_layer].float(), mask
        out, mask = self.seq.run([r.template.format(c) for c in captions], r.max_length + r.drop, padding="longest")
        kept = [h[m][r.drop:] for h, m in zip(out.hidden_states[r.hidden_layer].float(), mask)]
        length = max(k.shape[0] for k in kept)
        seq = torch.stack([F.pad(k, (0, 0, 0, length - k.shape[0])) for k in kept])
        return seq, torch.stack([torch.arange(length) < k.shape[0] for k in kept])

    def _check(self, seq: torch.Tensor, pooled: torch.Tensor | None) -> None:
        if seq.shape[-1] != self.spec.seq_dim:
            raise TextEncoderError(f"the {self.seq.kind} encoder {str(self.seq.folder)!r} gives width {seq.shape[-1]} "
                                   f"but the {self.family} model's text width is {self.spec.seq_dim}")
        if self.spec.pooled_dim and (pooled is None or pooled.shape[-1] != self.spec.pooled_dim):
            got = "none" if pooled is None else pooled.shape[-1]
            raise TextEncoderError(f"the CLIP encoder(s) give a pooled width {got} but the {self.family} model "
                                   f"takes {self.spec.pooled_dim}")

    def describe(self) -> dict[str, Any]:
        """``report.json`` ``text_encoder``."""
        return {"kind": "transformers", "encoders": [
            {"kind": e.kind, "folder": str(e.folder), "class": type(e.model).__name__} for e in (*self.clips, self.seq)]}


def _clip_pooled(out: Any) -> torch.Tensor:
    """A CLIP's pooled vector: the projected ``text_embeds`` (SD3) or the ``pooler_output`` (Flux)."""
    embeds = getattr(out, "text_embeds", None)
    return embeds if embeds is not None else out.pooler_output


class HFTextEncoder:
    """Captions -> :class:`TextBatch` with one generic encoder, for a family that declares no
    pipeline encoders: ``seq`` is its last hidden state ``(B, L, H)`` at the spec's length;
    ``pooled`` its pooled output when it has one, else the masked mean of ``seq``.

    Raises:
        TextEncoderError: the encoder's width does not match the family's text shapes.
    """

    def __init__(self, encoder: _Encoder, spec: TextSpec):
        self.encoder, self.spec = encoder, spec
        width = encoder.model.config.hidden_size
        if width != spec.seq_dim:
            raise TextEncoderError(f"text encoder hidden size {width} does not match the model's text "
                                   f"width {spec.seq_dim}")

    @torch.no_grad()
    def __call__(self, captions: list[str]) -> TextBatch:
        out, mask = self.encoder.run(captions, self.spec.max_length)
        seq = out.last_hidden_state.float()
        pooled = None
        if self.spec.pooled_dim:
            pooled = getattr(out, "pooler_output", None)
            if pooled is None:
                pooled = (seq * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
            if pooled.shape[-1] != self.spec.pooled_dim:
                raise TextEncoderError(f"text encoder pooled width {pooled.shape[-1]} does not match the "
                                       f"model's pooled width {self.spec.pooled_dim}")
            pooled = pooled.float()
        return TextBatch(seq, mask, pooled)

    def overflow(self, captions: list[str]) -> list[str | None]:
        """Per caption, how the encoder cuts it at the spec's length, or None."""
        return self.encoder.overflow(captions, self.spec.max_length)

    def describe(self) -> dict[str, Any]:
        """``report.json`` ``text_encoder``."""
        e = self.encoder
        return {"kind": "transformers", "encoders": [{"kind": e.kind, "folder": str(e.folder),
                                                      "class": type(e.model).__name__}]}


def load_text_encoders(folders: Sequence[str | Path], family: FamilyAdapter,
                       spec: TextSpec) -> TextEncoderSet | HFTextEncoder:
    """The family's text encoders from local folders (offline; ``.safetensors`` weights only).

    Each folder is identified by its ``config.json``; their kinds must be what the family's
    pipeline uses (:attr:`FamilyAdapter.text_encoders`; several CLIPs in the order given). A
    family that declares none takes one folder, used generically (:class:`HFTextEncoder`).
    Tokenizers are read from the folder or its pipeline sibling (``tokenizer``, ``tokenizer_2``).

    Raises:
        TextEncoderError: a folder is missing or unidentifiable, or the kinds given are not the
            family's (the message names what is missing or extra).
    """
    paths = [Path(f) for f in folders]
    for path in paths:
        if not path.is_dir():
            raise TextEncoderError(f"text encoder path {str(path)!r} is not a folder")
    kinds = [encoder_kind(p) for p in paths]
    recipe = family.text_encoders
    if recipe is None:
        if len(paths) != 1:
            raise TextEncoderError(f"family {family.name!r} declares no pipeline text encoders: give one "
                                   f"--text-encoder folder, not {len(paths)}")
        return HFTextEncoder(_Encoder(paths[0]), spec)
    if sorted(kinds) != sorted(recipe.kinds):
        given = ", ".join(f"{k} ({p})" for k, p in zip(kinds, paths))
        raise TextEncoderError(f"family {family.name!r} needs the text encoders {_needs(recipe)}; given: {given}")
    encoders = [_Encoder(p) for p in paths]
    clips = [e for e in encoders if e.kind == "clip" and recipe.seq != "clip"]
    seq = next(e for e in encoders if e.kind == recipe.seq)
    return TextEncoderSet(family.name, recipe, spec, clips, seq)


def _needs(recipe: TextEncoders | None) -> str:
    if recipe is None:
        return "<text encoder folder>"
    return " ".join(f"<{_NAMES.get(k, k)} folder>" for k in recipe.kinds)


def stand_in_warning(family: FamilyAdapter) -> str:
    """The loud one-line notice of a run whose captions go through the stand-in embedder."""
    return (f"captions are NOT encoded by a language model: the {family.name} run uses the deterministic stand-in "
            "word embedder (each word a fixed random vector; fine for the demo, meaningless for a real LoRA); "
            f"give --text-encoder {_needs(family.text_encoders)} (local folders), or a model folder with its "
            "text_encoder*/ subfolders")


def caption_overflow(encode_text: Callable[[list[str]], TextBatch], captions: list[str]) -> list[str | None]:
    """Per caption, how the text encoder cuts it to its length (``T5: 600 tokens, reads 512``), or
    None: the encoders' ``overflow`` (the tokenizers' own counts without truncation; the stand-in
    embedder's words). A caller's own function without ``overflow`` cannot say: all None."""
    overflow = getattr(encode_text, "overflow", None)
    return list(overflow(captions)) if callable(overflow) else [None] * len(captions)


def describe_text_encoder(encode_text: Callable[[list[str]], TextBatch]) -> dict[str, Any]:
    """What encodes the captions, for ``report.json`` ``text_encoder`` (``kind``: ``stand-in``,
    ``transformers`` or, for a caller's own function, ``custom``)."""
    describe = getattr(encode_text, "describe", None)
    return describe() if callable(describe) else {"kind": "custom", "what": type(encode_text).__name__}
