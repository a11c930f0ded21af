"""Text files as the tools that write them write them: captions, config files, prompts.

:func:`read_text` decodes UTF-8 with or without a byte-order mark (as Notepad, VS Code and most
captioning tools write it) and UTF-16 with a byte-order mark (Windows Notepad's "Unicode"),
then :func:`clean_text` removes what a reader cannot see (the byte-order mark, format
characters such as zero-width spaces and joiners, control characters other than whitespace) and
normalises to NFC (the composed form macOS and Windows input methods differ on), so a caption
typed on any system gives the same text.

Bytes that are not UTF-8 are refused, with one line naming the file and the byte offset, rather
than decoded as cp1252 (Windows' Western code page) with a warning: every byte sequence is
"valid" cp1252 apart from five bytes, so a caption saved in another legacy code page (cp1251
Cyrillic, Shift-JIS, GBK) would train silently as mojibake, and a warning in a long log is easily
missed, while re-saving the file as UTF-8 is one step in any editor. A NUL character is refused
too: it is what UTF-16 without a byte-order mark, or a file that is not text, looks like.
"""

from __future__ import annotations

import codecs
import unicodedata
from pathlib import Path
from typing import Any

_BOMS = ((codecs.BOM_UTF8, "utf-8-sig"), (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))
"""Byte-order marks read, and the codec that decodes (and drops) each; UTF-32 ones are not written
by editors users caption with (and ``FF FE 00 00`` reads as UTF-16 LE with a NUL, refused)."""


class TextFileError(ValueError):
    """A text file cannot be read as text; the message names the file, what it is and where."""


def clean_text(text: str) -> str:
    """``text`` without invisible characters, in Unicode normal form NFC.

    Removed: every format character (Unicode category ``Cf``: U+FEFF byte-order mark / zero-width
    no-break space, U+200B zero-width space, U+200C/U+200D zero-width (non-)joiners, U+2060 word
    joiner, U+00AD soft hyphen, bidirectional marks) and every control character (``Cc``) that
    is not whitespace (tab, line breaks stay). Unicode's own categories (``unicodedata``) are the
    rule, so no hand-kept list goes stale.
    """
    kept = "".join(c for c in text if not (unicodedata.category(c) == "Cf"
                                           or (unicodedata.category(c) == "Cc" and not c.isspace())))
    return unicodedata.normalize("NFC", kept)


def decode_text(data: bytes, what: str) -> str:
    """The text of a file's bytes, cleaned (:func:`clean_text`).

    Args:
        data: the file's bytes.
        what: the file as the message names it (``caption 'data/a.txt'``).

    Raises:
        TextFileError: the bytes are not UTF-8 (nor UTF-16 after its byte-order mark): the message
            gives the offset of the first bad byte; or the text holds a NUL character.
    """
    codec = next((name for bom, name in _BOMS if data.startswith(bom)), "utf-8")
    try:
        text = data.decode(codec)
    except UnicodeDecodeError as exc:
        bad = data[exc.start:exc.start + 4].hex(" ")
        raise TextFileError(f"{what} is not {codec.removesuffix('-sig').upper()} text: byte {exc.start} "
                            f"({bad}) cannot be decoded; save it as UTF-8") from exc
    if "\x00" in text:
        raise TextFileError(f"{what} holds a NUL character at character {text.index(chr(0))}: UTF-16 without a "
                            "byte-order mark, or not a text file; save it as UTF-8")
    return clean_text(text)


def read_text(path: str | Path, what: str) -> str:
    """The text of the file ``path`` (:func:`decode_text`).

    Args:
        what: what the file is, for the message (``caption``, ``config``); the path is added.

    Raises:
        TextFileError: see :func:`decode_text`; OSError: the file cannot be read.
    """
    return decode_text(Path(path).read_bytes(), f"{what} {str(path)!r}")


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``' ``object_pairs_hook`` that refuses a key given twice in one object (JSON
    itself keeps the last silently: ``{"lora_rank": 8, ..., "lora_rank": 16}`` would train at 16).

    Raises:
        ValueError: naming the key and both values.
    """
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice in one object ({out[key]!r}, then {value!r}); allowed each "
                             "key once")
        out[key] = value
    return out
