"""The newest valid checkpoint is never lost: damaged ones are skipped by name,
foreign directories are refused and never replaced, `keep` prunes only older ones.

All on real files under tmp_path: truncation, a flipped byte, a lost manifest,
an unfinished save (a crash while writing), a directory that is not ours.
"""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest

from dtlab.models.run import checkpoint
from dtlab.models.run.checkpoint import CheckpointError


def params(step: int) -> np.ndarray:
    return np.arange(1000.0) + step  # (1000,): 8 KB, distinct per step


def write(root, *steps: int, keep: int | None = None) -> list[str]:
    return [checkpoint.save(str(root), s, {"params": params(s), "opt.m": params(-s)},
                            {"note": s}, keep=keep) for s in steps]


def truncate(path: str, nbytes: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(nbytes)


def flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x40]))


def test_truncated_newest_falls_back_to_previous_naming_the_file(tmp_path):
    first, second = write(tmp_path, 10, 20)
    size = os.path.getsize(os.path.join(second, "params.npy"))
    truncate(os.path.join(second, "params.npy"), 4096)
    path, skipped = checkpoint.latest_valid(str(tmp_path))
    assert path == first
    assert skipped == [(second, f"params.npy: truncated (4096 of {size} bytes)")]
    with pytest.raises(CheckpointError, match=r"step-00000020: params.npy: truncated"):
        checkpoint.load(second)
    arrays, meta = checkpoint.load(path)
    np.testing.assert_array_equal(arrays["params"], params(10))
    assert meta["step"] == 10 and meta["format"] == checkpoint.FORMAT


def test_flipped_byte_is_a_checksum_mismatch(tmp_path):
    first, second = write(tmp_path, 10, 20)
    flip_byte(os.path.join(second, "opt.m.npy"), 500)
    path, skipped = checkpoint.latest_valid(str(tmp_path))
    assert path == first
    assert skipped == [(second, "opt.m.npy: checksum mismatch, the file is corrupt")]


def test_missing_manifest_and_missing_file_are_named(tmp_path):
    first, second, third = write(tmp_path, 10, 20, 30)
    os.remove(os.path.join(third, "meta.json"))
    os.remove(os.path.join(second, "params.npy"))
    path, skipped = checkpoint.latest_valid(str(tmp_path))
    assert path == first
    assert [p for p, _ in skipped] == [third, second]
    assert skipped[0][1].startswith("meta.json: missing (not a dtlab checkpoint")
    assert skipped[1][1] == "params.npy: missing from checkpoint"


def test_an_unfinished_save_is_removed_and_said(tmp_path, caplog):
    (first,) = write(tmp_path, 10)
    crashed = tmp_path / ".step-00000020.abc123"  # what save() leaves if killed mid-write
    crashed.mkdir()
    (crashed / "params.npy").write_bytes(b"\x93NUMPY")
    with caplog.at_level(logging.WARNING, logger="dtlab.models.run.checkpoint"):
        assert checkpoint.latest_valid(str(tmp_path)) == (first, [])
    assert f"{crashed}: removed (an unfinished save: the writer stopped before renaming it " \
           "into place)" in caplog.text
    assert sorted(os.listdir(tmp_path)) == ["step-00000010"]
    assert checkpoint.latest_valid(str(tmp_path), at_most=9) == (None, [])


def test_a_save_removes_what_killed_saves_left_before_it_writes(tmp_path, caplog):
    """A process that starts saving without --resume: its first save recovers the directory
    (the temporary directory of a killed save, the copy a killed replace had moved aside)."""
    (first,) = write(tmp_path, 10)
    aside = tmp_path / ".replaced-step-00000010.x1"  # killed between _replace's renames
    aside.mkdir()
    os.rename(first, aside / "old")
    (tmp_path / ".step-00000011.y2").mkdir()
    with caplog.at_level(logging.WARNING, logger="dtlab.models.run.checkpoint"):
        write(tmp_path, 12)
    assert "step-00000010: put back from" in caplog.text
    assert sorted(os.listdir(tmp_path)) == ["step-00000010", "step-00000012"]
    np.testing.assert_array_equal(checkpoint.load(first)[0]["params"], params(10))


def test_nothing_valid_gives_none_with_every_reason(tmp_path):
    first, second = write(tmp_path, 10, 20)
    truncate(os.path.join(first, "params.npy"), 0)
    flip_byte(os.path.join(second, "params.npy"), 200)
    path, skipped = checkpoint.latest_valid(str(tmp_path))
    assert path is None
    assert [p for p, _ in skipped] == [second, first]
    assert "checksum mismatch" in skipped[0][1] and "truncated (0 of" in skipped[1][1]
    assert checkpoint.latest_valid(str(tmp_path / "absent")) == (None, [])


def test_foreign_directories_are_named_and_never_replaced(tmp_path):
    (first,) = write(tmp_path, 10)
    foreign = tmp_path / "step-00000020"
    foreign.mkdir()
    (foreign / "meta.json").write_text(json.dumps({"owner": "someone else"}))
    (foreign / "data.bin").write_bytes(b"theirs")
    not_a_dir = tmp_path / "step-00000030"
    not_a_dir.write_text("a file")
    path, skipped = checkpoint.latest_valid(str(tmp_path))
    assert path == first
    assert skipped == [
        (str(not_a_dir), "not a directory, so not a dtlab checkpoint"),
        (str(foreign), 'meta.json: not a dtlab checkpoint manifest (no "files" and "step")')]
    with pytest.raises(CheckpointError, match=r"step-00000020 exists and is not a dtlab "
                                              r"checkpoint \(meta.json: not a dtlab"):
        write(tmp_path, 20)
    assert (foreign / "data.bin").read_bytes() == b"theirs"  # untouched
    assert sorted(os.listdir(tmp_path)) == ["step-00000010", "step-00000020", "step-00000030"]


def test_manifest_of_another_step_or_naming_outside_files_is_refused(tmp_path):
    first, second = write(tmp_path, 10, 20)
    meta_path = os.path.join(second, "meta.json")
    with open(meta_path) as f:
        meta = json.load(f)
    with open(meta_path, "w") as f:
        json.dump({**meta, "step": 7}, f)
    assert checkpoint.problem(second) == ("meta.json: says step 7, the directory is step "
                                          "00000020")
    with open(meta_path, "w") as f:
        json.dump({**meta, "files": {"../step-00000010/params.npy": "0"}}, f)
    assert "which is not a file of the checkpoint" in checkpoint.problem(second)
    assert checkpoint.latest_valid(str(tmp_path))[0] == first


def test_resaving_a_damaged_step_of_ours_replaces_it(tmp_path):
    first, second = write(tmp_path, 10, 20)
    truncate(os.path.join(second, "params.npy"), 100)
    again = write(tmp_path, 20)[0]
    assert again == second and checkpoint.problem(second) is None
    assert checkpoint.latest_valid(str(tmp_path)) == (second, [])
    assert sorted(os.listdir(tmp_path)) == ["step-00000010", "step-00000020"]


def test_keep_two_leaves_the_two_newest(tmp_path):
    write(tmp_path, 10, 20, 30, 40, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["step-00000030", "step-00000040"]
    for step in (30, 40):
        arrays, _ = checkpoint.load(os.path.join(tmp_path, checkpoint.step_dir(step)))
        np.testing.assert_array_equal(arrays["params"], params(step))


def test_keep_counts_only_checkpoints_that_verify(tmp_path):
    """A corrupt older one does not count towards K, so the newest valid older one stays."""
    first, second = write(tmp_path, 10, 20)
    flip_byte(os.path.join(second, "params.npy"), 300)
    foreign = tmp_path / "step-00000005"
    foreign.mkdir()
    write(tmp_path, 30, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["step-00000005", "step-00000010", "step-00000020",
                                            "step-00000030"]
    write(tmp_path, 40, keep=2)  # 30 verifies: 20 (corrupt) and 10 go, the foreign 5 stays
    assert sorted(os.listdir(tmp_path)) == ["step-00000005", "step-00000030", "step-00000040"]


def test_keep_never_removes_the_one_just_written_nor_newer_ones(tmp_path):
    write(tmp_path, 10, 20, 30)
    write(tmp_path, 15, keep=1)  # a resumed run behind the newest directory
    assert sorted(os.listdir(tmp_path)) == ["step-00000015", "step-00000020", "step-00000030"]


@pytest.mark.parametrize("keep", [0, -1])
def test_keep_below_one_is_refused_before_writing(tmp_path, keep):
    with pytest.raises(ValueError, match=f"checkpoint keep must be at least 1 \\(got {keep}\\)"):
        write(tmp_path, 10, keep=keep)
    assert os.listdir(tmp_path) == []
