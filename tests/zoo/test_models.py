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
