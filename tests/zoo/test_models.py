"""zoo/models.py: `tandem models list` and `tandem models path`, and what an unknown name says."""
from __future__ import annotations

from pathlib import Path

from zoo.models import main


def test_list_and_path_name_the_local_files(zoo_dir, capsys):
    assert main(["list"]) == 0
    listed = capsys.readouterr().out
    assert "smollm2-135m-instruct" in listed and "tandem-tiny" in listed
    assert main(["path", "tandem-tiny", "--head", "mtp"]) == 0
    head = Path(capsys.readouterr().out.strip())
    assert (head / "config.json").is_file() and head.name == "mtp"


def test_an_unknown_name_is_an_error_listing_the_names(capsys):
    assert main(["path", "no-such-model"]) == 2
    out = capsys.readouterr().out
    assert "unknown model 'no-such-model'" in out and "smollm2-135m-instruct" in out


def test_the_gguf_can_be_named_by_the_environment(tmp_path, monkeypatch):
    """$TANDEM_SMOLLM2_GGUF: the same file on a node where the package cannot be installed; a missing file there is
    reported as missing, not silently replaced by the package's copy."""
    from zoo.models import smollm2_gguf

    copy = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    copy.write_bytes(b"GGUF")
    monkeypatch.setenv("TANDEM_SMOLLM2_GGUF", str(copy))
    assert smollm2_gguf() == copy
    monkeypatch.setenv("TANDEM_SMOLLM2_GGUF", str(tmp_path / "absent.gguf"))
    assert smollm2_gguf() is None
