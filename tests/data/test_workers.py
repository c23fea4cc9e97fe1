"""The input's worker processes (`keras_vit.data.workers`): their batches are the in-process batches bit
for bit, in any order and after a resume; bad images met in a worker are counted in the reader; a worker
that dies or fails is an error at once, never a hang; the workers end with their reader."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from helpers import REPO
from PIL import Image

from keras_vit.data import pyinput, workers

READY_S = 180  # the fork server imports Keras once: seconds on a busy machine


def _folder(root, classes=("a", "b"), per_class=6):
    rng = np.random.default_rng(0)
    for name in classes:
        (root / name).mkdir(parents=True)
        for index in range(per_class):
            pixels = rng.integers(0, 256, (40, 48, 3)).astype("uint8")
            Image.fromarray(pixels).save(root / name / f"{index}.jpg", quality=90)
    return root


def _pipeline(source, **overrides):
    arguments = dict(image_size=32, batch_size=8, seed=5, steps_per_epoch=3, mixup_alpha=0.2, workers=2)
    return pyinput.train_pipeline(source, **{**arguments, **overrides})


def _started(batches):
    batches[0]  # made here while the workers start
    assert batches.pool.wait_ready(READY_S)
    return batches


def _same(got, expected):
    if isinstance(expected, dict):  # uint8 images with mixup's weights
        assert sorted(got) == sorted(expected)
        return _same([got[key] for key in sorted(got)], [expected[key] for key in sorted(expected)])
    assert len(got) == len(expected)
    for left, right in zip(got, expected, strict=True):
        if isinstance(right, dict):
            _same(left, right)
            continue
        assert left.dtype == right.dtype and left.shape == right.shape
        np.testing.assert_array_equal(left, right)


def test_worker_batches_are_the_in_process_batches_in_any_order_and_after_resume(tmp_path, monkeypatch):
    """A JPEG folder with a file that fails when read (skipped): the workers' batches (float32
    images in shared memory) equal the batches made in this process, read in turn, jumping back and
    from a pipeline resumed at epoch 2; the bad reads are counted as in one process."""
    root = _folder(tmp_path / "train")
    bad = root / "a" / "1.jpg"
    bad.write_bytes(bad.read_bytes()[:300])  # cut after the header: fails when decoded
    monkeypatch.setattr(pyinput, "image_problem", lambda path, max_pixels: None)
    pooled_source = pyinput.from_directory(root, on_bad_image="skip")
    local_source = pyinput.from_directory(root, on_bad_image="skip")
    local = _pipeline(local_source, workers=0)
    order = [1, 2, 3, 4, 5, 6, 7, 2, 3, 8]  # in turn, then back (a reader that starts over)
    with pytest.warns(UserWarning, match=rf"Skipped image file {bad}"):
        pooled = _started(_pipeline(pooled_source))
        local[0]  # as `_started` read the pooled one's: the reads counted are those of the batches read
        for index in order:
            _same(pooled[index], local[index])
    assert pooled.pool.wait_ready(0) and len(pooled.pool._processes) == 2
    assert pooled_source.bad_images.summary() == local_source.bad_images.summary()
    assert pooled_source.bad_images.summary()["reads_skipped"] >= 2 and pooled_source.bad_images.indices
    resumed = _started(_pipeline(pyinput.from_directory(root, on_bad_image="skip"), start_epoch=2))
    for index in range(3):
        _same(resumed[index], local[6 + index])
    pooled.close()
    resumed.close()


def test_evaluation_batches_through_the_workers(tmp_path, monkeypatch):
    """`eval_pipeline`'s batches (the last one padded) from the workers are the in-process ones, and a
    file skipped there is among the source's skipped examples (the driver leaves them out of the metrics)."""
    root = _folder(tmp_path / "val", per_class=10)
    bad = root / "b" / "7.jpg"
    bad.write_bytes(bad.read_bytes()[:300])
    monkeypatch.setattr(pyinput, "image_problem", lambda path, max_pixels: None)
    spec = pyinput.Preprocessing(32, crop_pct=None, interpolation="bicubic")
    pooled_source, local_source = (pyinput.from_directory(root, on_bad_image="skip") for _ in range(2))
    pooled = pyinput.eval_pipeline(pooled_source, spec, batch_size=6, pad=True, workers=2)
    local = pyinput.eval_pipeline(local_source, spec, batch_size=6, pad=True, workers=0)
    assert len(pooled) == 4
    with pytest.warns(UserWarning, match=rf"Skipped image file {bad}"):
        _started(pooled)
        local[0]
        for index in range(1, len(pooled)):
            _same(pooled[index], local[index])
    assert pooled_source.bad_images.indices == local_source.bad_images.indices == {17}
    pooled.close()


@pytest.mark.parametrize("pixels", ["float32", "uint8"])
def test_digits_batches_and_unlabeled_batches_through_the_workers(pixels):
    """Float32 batches, and the driver's uint8 ones with mixup's weights (a dict of arrays) alike."""
    train = pyinput.load_digits()[0]
    pooled = _started(_pipeline(train, image_size=16, pixels=pixels))
    images_only = pyinput.images_only(pooled)
    for index in range(1, 8):
        expected = pooled.make_item(index)
        _same(pooled[index], expected)
        if pixels == "float32":
            _same(images_only[index], expected[:1])
        else:
            assert expected[0]["images"].dtype == np.uint8 and expected[0]["mixup_weight"].dtype == np.float32
    pooled.close()


def test_a_worker_that_dies_is_an_error_not_a_hang():
    batches = _started(_pipeline(pyinput.load_digits()[0], image_size=16))
    batches[1]
    victim = batches.pool._processes[1]
    os.kill(victim.pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(workers.WorkerError, match=rf"pid {victim.pid}\) died .*signal 9 \(SIGKILL\)"):
        for index in range(2, 400):
            batches[index]
    assert time.monotonic() - started < 30
    with pytest.raises(workers.WorkerError):  # and stays so
        batches[500]
    processes = list(batches.pool._processes)
    batches.close()
    assert not any(process.is_alive() for process in processes)


def test_an_exception_in_a_worker_is_raised_in_the_reader(tmp_path, monkeypatch):
    """`on_bad_image="stop"`: the worker's `BadImageError` names the file, raised where the batch is read."""
    root = _folder(tmp_path / "train")
    bad = root / "b" / "2.jpg"
    monkeypatch.setattr(pyinput, "image_problem", lambda path, max_pixels: None)
    batches = _pipeline(pyinput.from_directory(root), mixup_alpha=0.0, steps_per_epoch=1)
    batches[0]
    assert batches.pool.wait_ready(READY_S)
    bad.write_bytes(bad.read_bytes()[:300])
    with pytest.raises(pyinput.BadImageError, match=rf"Image file {bad} cannot be read") as raised:
        for index in range(1, 8):
            batches[index]
    assert any("In input worker" in note for note in raised.value.__notes__)
    batches.close()


def test_a_dataset_that_cannot_travel_is_read_in_process_with_a_warning():
    images = np.zeros((16, 8, 8, 3), "uint8")
    source = pyinput.Source(16, 2, None, lambda index: (images[index], index % 2), np.arange(16) % 2)
    batches = _pipeline(source, image_size=8)
    with pytest.warns(UserWarning, match="need a dataset that pickles"):
        first = batches[0]
    _same(first, batches.make_item(0))
    assert batches.pool is None and batches.processes == 0


def test_workers_end_with_their_reader_and_do_not_rerun_its_script(tmp_path):
    """An unguarded script (no `if __name__ == "__main__":`) reads through 2 workers, then is SIGKILLed:
    the script ran once (the workers never import it) and no worker is left."""
    runs = tmp_path / "runs.txt"
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent(f"""
        import time
        from keras_vit.data import pyinput
        with open({str(runs)!r}, "a") as file:
            file.write("run\\n")
        batches = pyinput.train_pipeline(
            pyinput.load_digits()[0], image_size=16, batch_size=8, seed=0, steps_per_epoch=3, workers=2
        )
        batches[0]
        assert batches.pool.wait_ready({READY_S})
        batches[1]
        print(" ".join(str(process.pid) for process in batches.pool._processes), flush=True)
        time.sleep(300)
        """)
    )
    environment = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, str(script)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=environment)
    pids = [int(pid) for pid in process.stdout.readline().split()]
    assert len(pids) == 2
    process.kill()
    process.wait()

    def alive(pid):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                return stat.read().split()[2] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 20
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(pid) for pid in pids)
    assert runs.read_text() == "run\n"
