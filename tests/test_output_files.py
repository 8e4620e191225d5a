"""What packlora leaves on disk: files and folders with the modes the user's umask gives any new
file (a merged model must be readable by the server that runs it), and output folders that
appear whole or not at all."""
import os
import stat
from pathlib import Path

import numpy as np
import pytest
from packlora.fileio import atomic_folder, save_safetensors, write_json, write_text


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077], indirect=True,
                         ids=["022", "002", "077"])
def test_files_and_folders_get_the_umask_modes(tmp_path, umask):
    save_safetensors(tmp_path / "a.safetensors", {"x": np.zeros(3, np.float32)})
    write_json(tmp_path / "b.json", {"k": 1})
    with atomic_folder(tmp_path / "out") as tmp:
        write_json(Path(tmp) / "c.json", {})
    assert _mode(tmp_path / "a.safetensors") == 0o666 & ~umask
    assert _mode(tmp_path / "b.json") == 0o666 & ~umask
    assert _mode(tmp_path / "out") == 0o777 & ~umask
    assert _mode(tmp_path / "out" / "c.json") == 0o666 & ~umask
    assert os.umask(umask) == umask  # reading the umask left it as it was


def test_a_rewritten_file_keeps_its_mode(tmp_path):
    """metrics.jsonl chmod-ed to 0600 came back 0644 when a resumed run rewrote it."""
    path = tmp_path / "metrics.jsonl"
    write_text(path, "one\n")
    os.chmod(path, 0o600)
    write_text(path, "two\n")
    assert _mode(path) == 0o600 and path.read_text() == "two\n"


def test_a_folder_appears_whole_or_not_at_all(tmp_path):
    with pytest.raises(KeyboardInterrupt), atomic_folder(tmp_path / "out") as tmp:
        write_json(Path(tmp) / "a.json", {})
        raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []  # no output, no temp folder
    empty = tmp_path / "empty"
    empty.mkdir()
    inode = os.stat(empty).st_ino  # a shell standing in it still sees the files
    with atomic_folder(empty) as tmp:  # an empty folder is filled, not replaced
        write_json(Path(tmp) / "a.json", {})
    assert [p.name for p in empty.iterdir()] == ["a.json"] and os.stat(empty).st_ino == inode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def test_a_failing_write_names_the_output_not_the_temp_folder(tmp_path):
    with pytest.raises(OSError) as e, atomic_folder(tmp_path / "out") as tmp:
        raise OSError(28, "No space left on device", os.path.join(tmp, "model.safetensors"))
    assert e.value.filename == str(tmp_path / "out" / "model.safetensors")
    assert e.value.errno == 28
    assert list(tmp_path.iterdir()) == []
