"""Text enters normalised: captions, config files and prompts read as the tools that write them
write them, and captions matched to images as Windows and macOS match names."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from segmented_checkpointing.engine.config import CheckpointSchedule, TrainConfig, read_config_file
from segmented_checkpointing.engine.config.options import ConfigError
from segmented_checkpointing.engine.data.folder import DatasetError, scan_folder
from segmented_checkpointing.engine.files.text import TextFileError, clean_text, decode_text

CAPTION = "a red square on a white table"


def _image(path, size=(16, 16)):
    Image.new("RGB", size, (200, 30, 30)).save(path)


def _captions(folder):
    return {s.image.name: s.caption for s in scan_folder(folder)}


def test_a_caption_with_a_byte_order_mark_equals_the_plain_one(tmp_path):
    line = CAPTION + "\r\n"  # as Notepad ends a line
    encodings = {"plain": line.encode(), "utf8bom": b"\xef\xbb\xbf" + line.encode(),
                 "utf16le": line.encode("utf-16"),  # Notepad's "Unicode": FF FE, then UTF-16 LE
                 "utf16be": b"\xfe\xff" + line.encode("utf-16-be")}
    assert encodings["utf16le"][:2] == b"\xff\xfe"
    for name, data in encodings.items():
        _image(tmp_path / f"{name}.png")
        (tmp_path / f"{name}.txt").write_bytes(data)
    assert _captions(tmp_path) == {f"{name}.png": CAPTION for name in encodings}


def test_invisible_characters_are_removed_and_text_is_composed():
    assert clean_text("a\u200b red\u2060 square\u200d\ufeff\u00ad") == "a red square"
    assert clean_text("caf" + "e\u0301") == "caf\u00e9" and len(clean_text("cafe\u0301")) == 4  # NFD -> NFC
    assert clean_text("tab\tand\nnew\x07line\x1b") == "tab\tand\nnewline"  # whitespace kept, other controls not
    assert decode_text(b"\xef\xbb\xbfone \xe2\x80\x8btwo", "caption 'x.txt'") == "one two"


def test_a_caption_in_another_encoding_is_refused_naming_the_file_and_the_byte(tmp_path):
    _image(tmp_path / "latin.png")
    (tmp_path / "latin.txt").write_bytes("café au lait".encode("cp1252"))  # é = e9
    with pytest.raises(DatasetError, match=r"caption '.*latin\.txt' is not UTF-8 text: byte 3 \(e9 20 61 75\)"):
        scan_folder(tmp_path)


def test_utf16_without_a_byte_order_mark_is_refused():
    with pytest.raises(TextFileError, match="NUL character at character 1: UTF-16 without a byte-order mark"):
        decode_text("ab".encode("utf-16-le"), "caption 'x.txt'")
    with pytest.raises(TextFileError, match=r"is not UTF-16 text: byte 4 \(62\)"):  # an odd byte at the end
        decode_text(b"\xff\xfea\x00b", "caption 'x.txt'")


def test_a_caption_is_found_whatever_the_letter_case_of_the_names(tmp_path):
    _image(tmp_path / "IMG_01.JPG")
    (tmp_path / "img_01.txt").write_text("first")
    _image(tmp_path / "photo.png")
    (tmp_path / "PHOTO.TXT").write_text("second")
    _image(tmp_path / "Cafe\u0301.png")  # a macOS name (NFD) with the caption written elsewhere (NFC)
    (tmp_path / "caf\u00e9.txt").write_text("third")
    _image(tmp_path / "alone.png")
    assert _captions(tmp_path) == {"IMG_01.JPG": "first", "photo.png": "second", "Cafe\u0301.png": "third",
                                   "alone.png": ""}


def test_two_captions_differing_only_in_case_are_refused_naming_both(tmp_path):
    _image(tmp_path / "a.png")
    (tmp_path / "a.txt").write_text("lower")
    (tmp_path / "A.txt").write_text("upper")
    with pytest.raises(DatasetError, match=r"captions '.*/A\.txt' and '.*/a\.txt' of image '.*a\.png' differ only "
                                           "in letter case"):
        scan_folder(tmp_path)


def test_config_files_are_read_by_the_same_reader(tmp_path):
    keys = {"steps": 3, "gradient_checkpointing_interval": 2}
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(keys).encode())
    (tmp_path / "utf16.json").write_bytes(json.dumps(keys).encode("utf-16"))
    assert read_config_file(tmp_path / "bom.json") == keys and read_config_file(tmp_path / "utf16.json") == keys
    assert CheckpointSchedule.from_json_file(tmp_path / "bom.json").gradient_checkpointing_interval == 2
    (tmp_path / "latin.json").write_bytes(b'{"output": "caf\xe9"}')
    with pytest.raises(ConfigError, match=r"^config '.*latin\.json' is not UTF-8 text: byte 15 \(e9 22 7d\)"):
        read_config_file(tmp_path / "latin.json")


def test_validation_prompts_are_cleaned_as_captions_are():
    config = TrainConfig.create(validation_prompts=("a\u200b cat", "cafe\u0301"))
    assert config.validation.validation_prompts == ("a cat", "caf\u00e9")
