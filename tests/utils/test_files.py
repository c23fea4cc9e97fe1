"""Nothing of the user's is lost, no edited file taken for a good one: owned writes, run lock, checksums.

Every writer (`save_pretrained`, `keras-vit convert`, `export`, the training driver) replaces
only its own earlier output and refuses an output that holds its input; a run folder is locked
while a run writes to it (tested with a real second process, and one killed by SIGKILL);
backups and `save_pretrained` folders record SHA-256 checksums that are verified on reading.
"""

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import keras
import numpy as np
import pytest
from helpers import subprocess_env

import keras_vit
from keras_vit import cli
from keras_vit.registry.variants import ViTConfig
from keras_vit.training import classification as training
from keras_vit.training import runs
from keras_vit.training.runs.backup import BackupMismatchError, sign_state
from keras_vit.training.runs.driver import open_run_folder
from keras_vit.utils.files import (
    LOCK_FILE,
    ChecksumError,
    RunInUseError,
    RunLock,
    json_sha256,
    open_for_writing,
    refuse_overlap,
    replace_file,
    write_owned,
)

TINY = ViTConfig("tiny_vit", 4, 32, 2, 2, 64, image_size=32)
RUN_TINY = ViTConfig(
    "vit_tiny_test", patch_size=8, hidden_size=32, depth=2, num_heads=2, mlp_dim=64, image_size=16
)
TIMEOUT = 120


@pytest.fixture(scope="module")
def tiny():
    model = keras_vit.build_vit(TINY, num_classes=5, classifier_activation=None)
    rng = np.random.default_rng(0)
    for variable in model.weights:
        variable.assign(rng.normal(0, 0.1, variable.shape).astype("float32"))
    return model


def _names(folder) -> list[str]:
    return sorted(os.listdir(folder))


def _fill(contents: dict[str, str]):
    def fill(staging):
        for name, text in contents.items():
            (staging / name).write_text(text)

    return fill


# ---- owned writes -----------------------------------------------------------------------------


def test_write_owned_replaces_only_its_own_files(tmp_path):
    new = tmp_path / "new"
    write_owned(new, {"a", "b"}, _fill({"a": "1", "b": "1"}))
    assert _names(new) == ["a", "b"] and _names(tmp_path) == ["new"]  # renamed into place, no staging

    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("user")
    (folder / "sub").mkdir()
    write_owned(folder, {"a", "b"}, _fill({"a": "1", "b": "1"}))
    with pytest.raises(FileExistsError, match=r"already holds keras_vit output \(a, b\).*overwrite=True"):
        write_owned(folder, {"a"}, _fill({"a": "2"}), earlier={"a", "b"})
    # overwrite: its own files replaced, the one no longer written removed, the user's kept
    write_owned(folder, {"a", "c"}, _fill({"a": "2", "c": "2"}), earlier={"a", "b"}, overwrite=True, last="a")
    assert _names(folder) == ["a", "c", "notes.txt", "sub"]
    assert (folder / "a").read_text() == "2" and (folder / "notes.txt").read_text() == "user"
    # a file of a name it writes that it did not write is refused, even with overwrite
    with pytest.raises(FileExistsError, match=r"already has notes\.txt, not written by keras_vit"):
        write_owned(folder, {"notes.txt"}, _fill({"notes.txt": "x"}), earlier={"a"}, overwrite=True)
    assert (folder / "notes.txt").read_text() == "user"

    (tmp_path / "file").write_text("user")
    with pytest.raises(FileExistsError, match="is not a folder"):
        write_owned(tmp_path / "file", {"a"}, _fill({"a": "1"}))


@pytest.mark.parametrize("fault", ["oserror", "safetensors"])
@pytest.mark.parametrize("into", ["new", "existing"])
def test_write_owned_errors_name_the_folder_given_not_the_staging_one(tmp_path, fault, into):
    """A write that fails midway (here a full disk: a real one gives the same errors) names the
    folder the user gave; nothing is left behind."""
    from safetensors import SafetensorError

    folder = tmp_path / "out"
    if into == "existing":
        folder.mkdir()

    def fill(staging):
        (staging / "model.safetensors").write_bytes(b"half")
        if fault == "oserror":
            raise OSError(errno.ENOSPC, "No space left on device", str(staging / "model.safetensors"))
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    with pytest.raises(OSError, match=rf"^\[Errno 28\] Cannot write into {folder}: No space left") as caught:
        write_owned(folder, {"model.safetensors"}, fill)
    assert ".tmp-" not in str(caught.value) and caught.value.filename is None
    assert _names(tmp_path) == (["out"] if into == "existing" else [])
    if into == "existing":
        assert _names(folder) == []


def test_save_pretrained_into_an_unwritable_place_names_it(tiny, tmp_path):
    (tmp_path / "afile").write_text("user")
    with pytest.raises(
        NotADirectoryError, match=rf"Cannot create {tmp_path}/afile/out: {tmp_path}/afile is a file"
    ):
        keras_vit.save_pretrained(tiny, tmp_path / "afile" / "out")
    with pytest.raises(OSError, match=r"^\[Errno \d+\] Cannot write into /proc/keras_vit_out: ") as caught:
        keras_vit.save_pretrained(tiny, "/proc/keras_vit_out")  # a place nobody can write into, root too
    assert ".tmp-" not in str(caught.value)
    assert (tmp_path / "afile").read_text() == "user"


def test_refuse_overlap(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "model.keras").write_text("model")
    with pytest.raises(ValueError, match=r"The output .*run holds the input .*model\.keras"):
        refuse_overlap(run, [run / "model.keras"])
    with pytest.raises(ValueError, match=r"The output .*model\.keras is the input"):
        refuse_overlap(str(run) + "/./model.keras", [run / "model.keras"])
    refuse_overlap(tmp_path / "out", [run / "model.keras", None, "vit_b16", tmp_path / "missing"])
    refuse_overlap(tmp_path / "ru", [run / "model.keras"])  # a name prefix is no parent folder


def test_json_checksum_ignores_spelling_not_values():
    assert json_sha256({"b": 1, "a": [1.5]}) == json_sha256(json.loads('{"a": [1.5],  "b": 1}'))
    assert json_sha256({"num_heads": 2}) != json_sha256({"num_heads": 4})


# ---- the run lock -----------------------------------------------------------------------------

_HOLD = textwrap.dedent(
    """
    import sys, time
    from keras_vit.utils.files import RunLock
    RunLock(sys.argv[1]).acquire()
    print("locked", flush=True)
    time.sleep(600)
    """
)


def _hold_lock(folder) -> subprocess.Popen:
    """A second process that takes the run lock on `folder` and keeps it until killed."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(folder)], env=subprocess_env(), stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_run_lock_names_the_holder_and_is_taken_over_after_sigkill(tmp_path):
    folder = tmp_path / "run"
    holder = _hold_lock(folder)
    try:
        with pytest.raises(
            RunInUseError, match=rf"{folder} is in use by another training run \(pid {holder.pid} on "
        ):
            RunLock(folder).acquire()
        holder.send_signal(signal.SIGKILL)
        assert holder.wait(timeout=TIMEOUT) == -signal.SIGKILL
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    assert (folder / LOCK_FILE).exists()  # the dead run's lock file, no longer locked
    with RunLock(folder):
        record = json.loads((folder / LOCK_FILE).read_text())
        assert record["pid"] == os.getpid()
        with pytest.raises(RunInUseError, match=rf"pid {os.getpid()}"):
            RunLock(folder).acquire()
    assert _names(folder) == []  # the lock file goes with the run


def test_run_lock_never_writes_through_a_planted_link(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    precious = tmp_path / "precious.txt"
    precious.write_text("the user's")
    (folder / LOCK_FILE).symlink_to("../precious.txt")
    with pytest.raises(FileExistsError, match=r"\.keras_vit-run\.lock is a symbolic link .*remove the link"):
        RunLock(folder).acquire()
    os.remove(folder / LOCK_FILE)
    os.link(precious, folder / LOCK_FILE)  # a hard link: the same file under the lock's name
    with pytest.raises(FileExistsError, match=r"has other names \(hard links\)"):
        RunLock(folder).acquire()
    assert precious.read_text() == "the user's"


def test_open_for_writing_writes_or_appends_and_never_through_a_link(tmp_path):
    """ "w" replaces the file's text, "a" appends to it; a symbolic or hard link at the name is refused
    before anything is written (what it points to is left as it was); other modes are refused."""
    path = tmp_path / "results.jsonl"
    for mode, text, expected in [("w", "1\n", "1\n"), ("a", "2\n", "1\n2\n"), ("w", "3\n", "3\n")]:
        with open_for_writing(path, mode) as file:
            file.write(text)
        assert path.read_text() == expected
    with open_for_writing(tmp_path / "new.bin", "ab") as file:
        file.write(b"\x00")
    assert (tmp_path / "new.bin").read_bytes() == b"\x00"
    precious = tmp_path / "precious.txt"
    precious.write_text("the user's")
    path.unlink()
    path.symlink_to(precious)
    for mode in ("w", "a"):
        with pytest.raises(FileExistsError, match=r"jsonl is a symbolic link \(to .*precious\.txt\)"):
            open_for_writing(path, mode)
    path.unlink()
    os.link(precious, path)
    with pytest.raises(FileExistsError, match=r"a hard link \(2 names for one file\)"):
        open_for_writing(path, "a")
    assert precious.read_text() == "the user's"
    with pytest.raises(ValueError, match="writes \\('w'\\) or appends \\('a'\\), not mode 'r\\+'"):
        open_for_writing(tmp_path / "other", "r+")


def test_training_refuses_a_locked_run_folder(tmp_path):
    folder = tmp_path / "run"
    holder = _hold_lock(folder)
    try:
        with pytest.raises(RunInUseError, match=rf"in use by another training run \(pid {holder.pid} "):
            training.train(RUN_TINY, output_dir=folder, steps=2, batch_size=32, verbose=0)
    finally:
        holder.kill()
        holder.wait()
    assert _names(folder) == [LOCK_FILE]  # nothing written


# ---- the training run folder ------------------------------------------------------------------


def _backup_of(folder, run: dict, epoch: int = 2) -> None:
    """A valid backup state of `run` after `epoch` (its weights file a stand-in)."""
    folder.mkdir(parents=True, exist_ok=True)
    name = f"epoch-{epoch:06d}.weights.h5"
    (folder / name).write_bytes(b"weights")
    state = {"epoch": epoch, "weights": name, "sha256": {name: runs.file_sha256(folder / name)}, "run": run}
    (folder / "state.json").write_text(json.dumps(sign_state(state)))


def test_run_folder_resumes_refuses_or_discards_an_unfinished_run(tmp_path, capsys):
    output, backup = tmp_path / "run", tmp_path / "run" / "backup"
    _backup_of(backup, {"steps": 16})
    assert open_run_folder(str(output), str(backup), "model.keras", {"steps": 16}, False, True).epoch == 2
    assert "resuming the unfinished run in" in capsys.readouterr().err
    with pytest.raises(BackupMismatchError, match=r"other arguments \(steps\).*--overwrite"):
        open_run_folder(str(output), str(backup), "model.keras", {"steps": 32}, False, True)
    assert open_run_folder(str(output), str(backup), "model.keras", {"steps": 32}, True, True).epoch == 0
    assert "discarded the unfinished run's backup" in capsys.readouterr().err
    assert not backup.exists()


def test_backup_with_an_edited_state_is_treated_as_damaged(tmp_path):
    run = {"steps": 16}
    _backup_of(tmp_path, run, epoch=3)
    state = json.loads((tmp_path / "state.json").read_text())
    (tmp_path / "state.json").write_text(json.dumps({**state, "epoch": 5}))  # valid JSON, hand-edited
    with pytest.raises(ValueError, match=r"state\.json does not match its own SHA-256 checksum \(edited"):
        runs.EpochBackup(tmp_path, run)
    _backup_of(tmp_path / "with_previous", run, epoch=3)
    previous = json.loads((tmp_path / "with_previous" / "state.json").read_text())
    (tmp_path / "with_previous" / "state-previous.json").write_text(json.dumps(previous))
    (tmp_path / "with_previous" / "state.json").write_text(json.dumps({**previous, "epoch": 5}))
    with pytest.warns(UserWarning, match=r"Damaged backup ignored: .*state\.json does not match its own"):
        assert runs.EpochBackup(tmp_path / "with_previous", run).epoch == 3


def test_removing_a_backup_removes_only_what_the_run_wrote(tmp_path):
    backup = tmp_path / "run" / "backup"
    _backup_of(backup, {"steps": 16})
    (backup / "state.json.partial").write_text("{")
    (backup / "settings.json").write_text("the user's")
    (backup / "notes.weights.h5").write_text("the user's")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "epoch-000001.weights.h5").write_text("the user's")
    (backup / "epoch-000001.weights.h5").symlink_to(elsewhere / "epoch-000001.weights.h5")
    runs.remove_backup(str(backup))
    assert _names(backup) == ["epoch-000001.weights.h5", "notes.weights.h5", "settings.json"]
    assert (elsewhere / "epoch-000001.weights.h5").read_text() == "the user's"


def test_removing_a_backup_that_a_partner_process_removes_meanwhile(tmp_path, monkeypatch):
    """A multi-process run's processes finish side by side: once the chief's backup files are gone
    another process may remove the emptied folder before the chief does. Not an error."""
    backup = tmp_path / "run" / "backup"
    _backup_of(backup, {"steps": 16})
    real_remove, left = os.remove, len(_names(backup))

    def remove_then_partner(path):
        nonlocal left
        real_remove(path)
        left -= 1
        if not left:  # the partner saw the folder empty
            os.rmdir(backup)

    monkeypatch.setattr(os, "remove", remove_then_partner)
    runs.remove_backup(str(backup))
    assert not backup.exists() and (tmp_path / "run").exists()


def test_a_backup_folder_that_is_a_link_is_neither_entered_nor_written(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    _backup_of(elsewhere, {"steps": 16})
    kept = _names(elsewhere)
    output = tmp_path / "run"
    output.mkdir()
    (output / "backup").symlink_to(elsewhere)
    runs.remove_backup(str(output / "backup"))
    with pytest.raises(ValueError, match=r"backup is a symbolic link \(to .*elsewhere\).*Remove the link"):
        training.train(RUN_TINY, output_dir=output, steps=2, batch_size=32, verbose=0)
    assert _names(elsewhere) == kept
    assert _names(output) == ["backup"]


def test_without_an_output_folder_each_run_gets_its_own(tmp_path, monkeypatch, capsys):
    """`keras-vit train` without --output-dir: vit_run, else the first of vit_run-2, ... without a
    finished run (an unfinished one is resumed there); --output-dir keeps the folder as typed."""
    from keras_vit.cli import commands

    monkeypatch.chdir(tmp_path)
    parser = cli.build_parser()
    defaulted, typed = parser.parse_args(["train"]), parser.parse_args(["train", "--output-dir", "vit_run"])
    for args in (defaulted, typed):
        commands._run_folder(args, "model.keras")
        assert args.output_dir == "vit_run"
    for name in ("vit_run", "vit_run-2"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.keras").write_bytes(b"a finished run")
    (tmp_path / "vit_run-3" / "backup").mkdir(parents=True)  # an unfinished run: resumed, not skipped
    defaulted, typed = parser.parse_args(["train"]), parser.parse_args(["train", "--output-dir", "vit_run"])
    commands._run_folder(defaulted, "model.keras")
    commands._run_folder(typed, "model.keras")
    assert (defaulted.output_dir, typed.output_dir) == ("vit_run-3", "vit_run")
    assert "vit_run holds a finished run: this run writes to vit_run-3" in capsys.readouterr().err


@pytest.mark.slow
def test_training_never_replaces_a_finished_run_unless_asked(tmp_path, capsys):
    output = tmp_path / "run"
    output.mkdir()
    (output / "notes.txt").write_text("user")
    arguments = dict(output_dir=output, steps=2, steps_per_epoch=1, batch_size=32, verbose=0)
    training.train(RUN_TINY, **arguments)
    assert "starting a new run in" in capsys.readouterr().err
    finished = {name: (output / name).read_bytes() for name in ("model.keras", "report.json", "labels.txt")}
    with pytest.raises(
        FileExistsError,
        match=r"holds a finished run \(model\.keras, report\.json, labels\.txt\).*--overwrite",
    ):
        training.train(RUN_TINY, **arguments)
    assert all((output / name).read_bytes() == data for name, data in finished.items())
    events = sorted((output / "logs" / "train").iterdir())
    command = [
        "train", "--output-dir", str(output), "--steps", "2", "--steps-per-epoch", "1", "--batch-size", "32",
        "--verbose", "0", "--patch-size", "8", "--hidden-size", "32", "--depth", "2", "--heads", "2",
        "--mlp-dim", "64", "--image-size", "16",
    ]  # fmt: skip
    assert cli.main(command) == 1
    assert "holds a finished run" in capsys.readouterr().err
    # the run's records name its TensorBoard files; the user's files beside them are not the run's
    report = json.loads((output / "report.json").read_text())
    assert report["log_files"] == sorted(f"logs/train/{path.name}" for path in events) and events
    for mine in ("logs/train/my_notes.txt", "logs/validation/x.csv", "logs/readme.md"):
        (output / mine).parent.mkdir(parents=True, exist_ok=True)
        (output / mine).write_text("the user's")
    assert cli.main([*command, "--overwrite"]) == 0
    assert "replacing the finished run in" in capsys.readouterr().err
    assert (output / "notes.txt").read_text() == "user"
    assert not set(events) & set((output / "logs" / "train").iterdir())  # the old run's logs are gone
    for mine in ("logs/train/my_notes.txt", "logs/validation/x.csv", "logs/readme.md"):
        assert (output / mine).read_text() == "the user's"
    assert sorted(_names(output)) == ["labels.txt", "logs", "model.keras", "notes.txt", "report.json"]


def test_overwrite_removes_only_the_log_files_the_report_names(tmp_path):
    """A finished run's report names its TensorBoard files: only those go (regular files under logs/train
    or logs/validation with TensorBoard's name), never a name outside them, a link or what it points to;
    a report that names none (an older run's) leaves logs/ as it is."""
    output, precious = tmp_path / "run", tmp_path / "precious.txt"
    precious.write_text("the user's")
    train, validation = output / "logs" / "train", output / "logs" / "validation"
    train.mkdir(parents=True)
    validation.mkdir()
    ours = ["logs/train/events.out.tfevents.1.h.2.0.v2", "logs/validation/events.out.tfevents.3.h.2.1.v2"]
    for name in ours:
        (output / name).write_text("events")
    (train / "events.out.tfevents.9.host.9.0.v2").write_text("the user's own, not named")
    (train / "events.out.tfevents.link.v2").symlink_to(precious)
    (output / "model.keras").write_text("model")
    link = "logs/train/events.out.tfevents.link.v2"
    named = [*ours, "logs/train/../../../precious.txt", "../precious.txt", link]
    for report, left in (({}, 4), ({"log_files": named}, 2)):
        (output / "report.json").write_text(json.dumps(report))
        (output / "model.keras").write_text("model")
        open_run_folder(str(output), str(output / "backup"), "model.keras", {}, overwrite=True, chief=True)
        kept = list(train.iterdir()) + (list(validation.iterdir()) if validation.exists() else [])
        assert len(kept) == left
    assert precious.read_text() == "the user's" and (train / "events.out.tfevents.link.v2").is_symlink()
    assert not validation.exists()  # emptied by the removal: the folder went too
    assert sorted(os.listdir(train)) == ["events.out.tfevents.9.host.9.0.v2", "events.out.tfevents.link.v2"]


def test_training_output_folder_that_is_a_file(tmp_path):
    (tmp_path / "run").write_text("user")
    with pytest.raises(NotADirectoryError, match=r"output_dir .*run. is a file, not a folder: give a folder"):
        training.train(RUN_TINY, output_dir=tmp_path / "run", steps=2, batch_size=32, verbose=0)
    assert (tmp_path / "run").read_text() == "user"


def test_training_output_must_not_hold_the_data(tmp_path):
    images = tmp_path / "images"
    for split in ("train", "test"):
        for label in ("a", "b"):
            (images / split / label).mkdir(parents=True)
    with pytest.raises(ValueError, match=r"The output .* holds the input .*images"):
        training.train(RUN_TINY, images, output_dir=tmp_path, steps=1, batch_size=2, verbose=0)


# ---- save_pretrained / load_pretrained --------------------------------------------------------


def test_save_pretrained_replaces_only_its_own_earlier_output(tiny, tmp_path):
    folder = tmp_path / "shared"
    folder.mkdir()
    (folder / "notes.txt").write_text("user")
    (folder / "data").mkdir()
    keras_vit.save_pretrained(tiny, folder, "hf")
    keras_vit.save_pretrained(tiny, folder, "google_npz", overwrite=True)  # the hf files are its own
    assert _names(folder) == ["README.md", "data", "keras_vit.json", "model.npz", "notes.txt"]
    keras_vit.load_pretrained(folder)

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "README.md").write_text("the user's own")
    with pytest.raises(FileExistsError, match=r"already has README\.md, not written by keras_vit"):
        keras_vit.save_pretrained(tiny, theirs, overwrite=True)
    assert _names(theirs) == ["README.md"]


def test_save_pretrained_overwrite_keeps_a_file_the_user_changed(tiny, tmp_path):
    folder = keras_vit.save_pretrained(tiny, tmp_path / "shared")
    keras_vit.save_pretrained(tiny, folder, overwrite=True)  # its own card, unchanged: replaced
    (folder / "README.md").write_text("the user's own card")
    before = {name: (folder / name).read_bytes() for name in _names(folder)}
    with pytest.raises(FileExistsError, match=r"already has README\.md, not written by keras_vit or changed"):
        keras_vit.save_pretrained(tiny, folder, "hf", overwrite=True)
    assert {name: (folder / name).read_bytes() for name in _names(folder)} == before


def test_save_pretrained_records_checksums_and_load_verifies_them(tiny, tmp_path):
    folder = keras_vit.save_pretrained(tiny, tmp_path / "shared")
    metadata = json.loads((folder / "keras_vit.json").read_text())
    assert sorted(metadata["files"]) == ["config.json", "model.safetensors"]
    assert metadata["files"]["model.safetensors"] == runs.file_sha256(folder / "model.safetensors")

    # a num_heads edit that keeps every shape: caught by the metadata's own checksum
    edited = json.loads(json.dumps(metadata))
    edited["model"]["config"]["num_heads"] = 4
    (folder / "keras_vit.json").write_text(json.dumps(edited, indent=2))
    with pytest.raises(
        ChecksumError, match=r"keras_vit\.json does not match its recorded SHA-256 .*verify=False"
    ):
        keras_vit.load_pretrained(folder)
    assert keras_vit.load_pretrained(folder, verify=False).config.num_heads == 4  # the opt-out
    (folder / "keras_vit.json").write_text(json.dumps(metadata))  # back as written (spacing aside)
    keras_vit.load_pretrained(folder)

    # one weight value changed
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match=r"model\.safetensors does not match the SHA-256 checksum"):
        keras_vit.load_pretrained(folder)
    # the same check where a folder is given as pretrained= (create_model) or to load_weights
    with pytest.raises(ChecksumError, match=rf"{folder}/model\.safetensors does not match .*verify=False"):
        keras_vit.create_model(TINY, folder, num_classes=5)
    with pytest.raises(ChecksumError, match=r"model\.safetensors does not match"):
        keras_vit.load_weights(keras_vit.build_vit(TINY, num_classes=5), folder)
    with pytest.raises(ChecksumError, match=r"model\.safetensors does not match"):  # the file, not the folder
        keras_vit.load_weights(keras_vit.build_vit(TINY, num_classes=5), folder / "model.safetensors")
    keras_vit.load_weights(
        keras_vit.build_vit(TINY, num_classes=5), folder / "model.safetensors", verify=False
    )
    keras_vit.create_model(TINY, folder, num_classes=5, verify=False)  # the opt-out
    assert cli.main(["convert", str(folder), str(tmp_path / "out.keras")]) == 1
    assert cli.main(["convert", str(folder), str(tmp_path / "out.keras"), "--no-verify"]) == 0

    os.remove(folder / "config.json")
    with pytest.raises(ChecksumError, match=r"config\.json is missing"):
        keras_vit.load_pretrained(folder)


# ---- convert and export -----------------------------------------------------------------------


def test_cli_convert_refuses_an_output_holding_its_input(tiny, tmp_path, capsys):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    tiny.save(run / "model.keras")
    (run / "report.json").write_text("{}")
    (run / "labels.txt").write_text("\n".join(f"c{index}" for index in range(5)))
    before = _names(run)
    assert cli.main(["convert", str(run / "model.keras"), str(run), "--to", "timm", "--overwrite"]) == 1
    assert "holds the input" in capsys.readouterr().err
    assert cli.main(["convert", str(run / "model.keras"), str(run / "model.keras"), "--overwrite"]) == 1
    assert "is the input" in capsys.readouterr().err
    assert _names(run) == before


def test_export_replaces_only_an_earlier_export(tiny, tmp_path, capsys):
    export_dir = tmp_path / "exports"
    (export_dir / "1").mkdir(parents=True)
    (export_dir / "1" / "notes.txt").write_text("user")
    with pytest.raises(
        FileExistsError, match=r"is not a SavedModel \(overwrite replaces only an earlier export\)"
    ):
        keras_vit.export_serving(tiny, export_dir, overwrite=True, warmup=False)
    assert (export_dir / "1" / "notes.txt").read_text() == "user"
    tiny.save(export_dir / "1" / "model.keras")
    command = ["export", str(export_dir), "--model", str(export_dir / "1" / "model.keras")]
    assert cli.main([*command, "--overwrite", "--no-warmup"]) == 1
    assert "holds the input" in capsys.readouterr().err


def test_keras_model_stays_loadable(tiny, tmp_path):
    """`convert` to .keras writes the file atomically (a temporary name renamed onto it)."""
    folder = keras_vit.save_pretrained(tiny, tmp_path / "shared")
    assert cli.main(["convert", str(folder), str(tmp_path / "again.keras")]) == 0
    assert _names(tmp_path) == ["again.keras", "shared"]
    images = np.random.default_rng(1).normal(size=(2, 32, 32, 3)).astype("float32")
    again = keras_vit.load_model(tmp_path / "again.keras")
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(again(images)), keras.ops.convert_to_numpy(tiny(images))
    )


@pytest.mark.parametrize(
    "planted",
    [
        "report.json.partial",
        "labels.txt",
        "backup/state.json.partial",
        "backup/partial-epoch-000001.weights.h5",
    ],
)
@pytest.mark.parametrize("link", ["symbolic", "hard", "dangling"])
def test_a_run_never_writes_through_a_link_planted_under_a_name_it_writes(planted, link, tmp_path):
    """A link planted in the output folder under a name the driver writes (its temporary files too)
    leaves its target as it was: refused, or replaced by the run's own file, never written through."""
    precious = tmp_path / "precious.txt"
    precious.write_text("the user's")
    output = tmp_path / "run"
    (output / "backup").mkdir(parents=True)
    path = output / planted
    if link == "hard":
        os.link(precious, path)
    else:
        path.symlink_to(precious if link == "symbolic" else tmp_path / "nowhere.txt")
    try:
        training.train(RUN_TINY, output_dir=output, steps=2, steps_per_epoch=1, batch_size=32, verbose=0)
    except (OSError, ValueError) as error:  # refused: naming the planted file
        assert planted.split("/")[-1] in str(error)
    assert precious.read_text() == "the user's"
    assert not (tmp_path / "nowhere.txt").exists()
    assert sorted(os.listdir(tmp_path)) == ["precious.txt", "run"]


def test_the_run_files_are_never_written_through_a_link_planted_while_it_runs(tmp_path):
    """`write_json` (report.json, the backup's state) refuses a link at its temporary name even when it
    appeared after the run's start check, and leaves what it points to as it was."""
    from keras_vit.training.runs.backup import write_json

    precious = tmp_path / "precious.txt"
    precious.write_text("the user's")
    (tmp_path / "state.json.partial").symlink_to(precious)
    with pytest.raises(FileExistsError, match=r"state\.json\.partial is a symbolic link \(to .*precious"):
        write_json(str(tmp_path / "state.json"), {"epoch": 1})
    os.link(precious, tmp_path / "report.json.partial")
    with pytest.raises(FileExistsError, match=r"report\.json\.partial is a hard link \(2 names"):
        write_json(str(tmp_path / "report.json"), {"accuracy": 1.0})
    assert precious.read_text() == "the user's"
    assert not (tmp_path / "state.json").exists() and not (tmp_path / "report.json").exists()
    write_json(str(tmp_path / "fresh.json"), {"epoch": 2})
    assert json.loads((tmp_path / "fresh.json").read_text()) == {"epoch": 2}


def test_a_transposed_square_kernel_is_caught_by_the_folders_checksum_by_either_path(tmp_path):
    """A square kernel transposed in a save_pretrained folder's weights keeps every shape; the
    folder's record (keras_vit.json) catches it whether the folder or its file is loaded. A file with
    no record cannot be checked this way (the limit docs/reliability.md states)."""
    from safetensors.numpy import load_file, save_file

    from keras_vit.utils.files import ChecksumError

    folder = tmp_path / "pretrained"
    keras_vit.save_pretrained(keras_vit.create_model(TINY, num_classes=3), folder)
    tensors = load_file(folder / "model.safetensors")
    square = tensors["blocks.0.attn.proj.weight"]
    assert square.shape[0] == square.shape[1]
    tensors["blocks.0.attn.proj.weight"] = np.ascontiguousarray(square.T)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    for path in (folder, folder / "model.safetensors"):
        with pytest.raises(ChecksumError, match="does not match the SHA-256 checksum keras_vit.json records"):
            keras_vit.load_weights(keras_vit.create_model(TINY, num_classes=3), path)


@pytest.mark.parametrize("link", ["symbolic", "hard", "dangling"])
def test_replace_file_replaces_a_link_never_writes_through_it(link, tmp_path):
    """`keras-vit convert` and the ONNX/LiteRT exports (`replace_file`): a link where the file goes is
    replaced by a new file; what it pointed to stays as it was, and nothing is made elsewhere."""
    precious = tmp_path / "precious.keras"
    precious.write_text("the user's")
    path = tmp_path / "out" / "model.keras"
    path.parent.mkdir()
    if link == "hard":
        os.link(precious, path)
    else:
        path.symlink_to(precious if link == "symbolic" else tmp_path / "nowhere.keras")
    replace_file(path, lambda staging: Path(staging).write_text("new"))
    assert precious.read_text() == "the user's" and not (tmp_path / "nowhere.keras").exists()
    assert not path.is_symlink() and path.read_text() == "new" and os.stat(path).st_nlink == 1
    assert sorted(os.listdir(path.parent)) == ["model.keras"]
