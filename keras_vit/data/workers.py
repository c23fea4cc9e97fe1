"""Worker processes for the input without TensorFlow: batches made beside the GIL, in order.

`keras_vit.data.pyinput`'s training batches are a pure function of their index (of `(seed, epoch,
index)`), so any process can make any batch. `BatchPool` keeps `workers` processes, each holding a
copy of the dataset, and asks them for the next batches ahead of the one read: batch `i` is the
same bit for bit whichever process made it, and a run resumed at any index reads the same stream.

* Start: the processes come from a fork server (`multiprocessing`'s "forkserver", "spawn" where
  there is none) that imports `keras_vit.data.pyinput` once: never a fork of the training process,
  whose JAX or PyTorch threads a fork would copy mid-flight, and they do not run the reader's
  `__main__` script again (no `if __name__ == "__main__":` guard needed). Until they are ready (the server's
  imports take a few seconds) the batches asked for are made in the calling thread, so the first
  batch comes as soon as without workers.
* Transfer: a batch's arrays come back in one shared-memory block (`multiprocessing.shared_memory`)
  of the worker's, copied out by the reader and handed back for the worker's next batch; the rest
  (shapes, small arrays, bad-image records) by pipe.
* Bad images: what a worker's `BadImages` met while making a batch travels back with it and is
  merged into the dataset's own (`source.bad_images`) when the batch is read: the counts and files
  are those of the batches read, as when they are made in one process; `on_bad_image="stop"`'s
  `BadImageError` is raised in the reader.
* Failure: a worker that dies (killed, out of memory) ends the read with `WorkerError` naming it
  and its exit code, at once; an exception in a worker is raised again in the reader, its
  traceback in the message. Never a silent hang.
* Shutdown: `close()` (also at exit and when the dataset is collected) stops the workers; they
  ignore Ctrl-C (the reader handles it and closes them) and end on their own when the reader's
  process dies (their pipe closes), so a SIGKILL leaves no orphan.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import pickle
import signal
import threading
import time
import traceback
import warnings
import weakref
from multiprocessing import connection, shared_memory

import numpy as np

__all__ = ["BatchPool", "WorkerError", "PooledItems"]

_PRELOAD = ["keras_vit.data.pyinput"]
# Arrays from this size up travel in shared memory; smaller ones are pickled with the message.
_SHARED_BYTES = 1 << 16


class WorkerError(RuntimeError):
    """A worker process died, or failed in a way its exception could not say."""


def _context():
    methods = multiprocessing.get_all_start_methods()
    if "forkserver" in methods:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(_PRELOAD)  # only if the server is not running yet
        return context
    return multiprocessing.get_context("spawn")


try:  # the fork server's start, as multiprocessing has it (not on Windows)
    from multiprocessing import forkserver, popen_forkserver, reduction, spawn, util
    from multiprocessing.context import ForkServerProcess, set_spawning_popen

    class _Popen(popen_forkserver.Popen):
        """`popen_forkserver.Popen` whose child does not import the reader's `__main__` module."""

        def _launch(self, process_obj):  # popen_forkserver.Popen._launch less the two keys
            prep_data = spawn.get_preparation_data(process_obj._name)
            prep_data.pop("init_main_from_path", None)
            prep_data.pop("init_main_from_name", None)
            buf = io.BytesIO()
            set_spawning_popen(self)
            try:
                reduction.dump(prep_data, buf)
                reduction.dump(process_obj, buf)
            finally:
                set_spawning_popen(None)
            self.sentinel, w = forkserver.connect_to_new_process(self._fds)
            _parent_w = os.dup(w)
            self.finalizer = util.Finalize(self, util.close_fds, (_parent_w, self.sentinel))
            with open(w, "wb", closefd=True) as f:
                f.write(buf.getbuffer())
            self.pid = forkserver.read_signed(self.sentinel)

    class _Process(ForkServerProcess):
        @staticmethod
        def _Popen(process_obj):
            return _Popen(process_obj)

except ImportError:  # pragma: no cover - no fork server: "spawn"
    _Process = None


def _process_class(context):
    """The context's `Process`, whose children do not import the reader's `__main__` module.

    A child of "forkserver" or "spawn" runs the parent's main script again (as `__mp_main__`) before
    its target: a script that trains at its top level, unguarded by `if __name__ == "__main__":`,
    would train again in every worker. The workers need only keras_vit, so that step is left out.
    """
    if context.get_start_method() == "forkserver" and _Process is not None:
        return _Process
    return context.Process


def _take_bad_images(dataset) -> tuple | None:
    """What the worker's `BadImages` met since the last call (and forget it), or None."""
    source = getattr(dataset, "source", None)
    bad = getattr(source, "bad_images", None)
    if bad is None or not bad.reads:
        return None
    with bad._lock:
        record = (dict(bad.files), bad.reads, set(bad.indices))
        bad.files, bad.reads, bad.indices = {}, 0, set()
    return record


def _merge_bad_images(bad, record: tuple) -> None:
    """Add a worker's record (`_take_bad_images`) to the reader's `BadImages`, warning for new files."""
    files, reads, indices = record
    with bad._lock:
        new = [path for path in files if path not in bad.files]
        bad.files.update(files)
        bad.reads += reads
        bad.indices.update(indices)
    for path in new:
        warnings.warn(f"Skipped image file {path}, which cannot be read ({files[path]}).", stacklevel=4)


class _Blocks:
    """A worker's shared-memory blocks, reused: the reader hands each back once it copied it out
    (a fresh block per batch costs more in page faults and unlinking than the copy)."""

    def __init__(self):
        self.owned: dict[str, shared_memory.SharedMemory] = {}
        self.free: list[str] = []

    def take(self, size: int) -> shared_memory.SharedMemory:
        for name in self.free:
            if self.owned[name].size >= size:
                self.free.remove(name)
                return self.owned[name]
        block = shared_memory.SharedMemory(create=True, size=size)
        self.owned[block.name] = block
        return block

    def release(self, name: str) -> None:
        if name in self.owned:
            self.free.append(name)

    def unlink_all(self) -> None:
        for block in self.owned.values():
            block.close()
            try:
                block.unlink()
            except FileNotFoundError:
                pass
        self.owned.clear()


def _placeholder(item) -> bool:
    """Whether `item` stands for an array in a block: `("__array__", offset, shape, dtype)`."""
    return isinstance(item, tuple) and len(item) == 4 and isinstance(item[0], str) and item[0] == "__array__"


def _pack(value, blocks: _Blocks):
    """`value` with its large arrays moved into one shared-memory block: `(block name, structure)`."""
    arrays = []

    def walk(item):
        if isinstance(item, np.ndarray) and item.nbytes >= _SHARED_BYTES:
            arrays.append(item)
            return ("__array__", len(arrays) - 1, item.shape, item.dtype.str)
        if isinstance(item, tuple):
            return tuple(walk(part) for part in item)
        if isinstance(item, dict):  # a uint8 batch with mixup: {"images": ..., "mixup_weight": ...}
            return {key: walk(part) for key, part in item.items()}
        return item

    structure = walk(value)
    if not arrays:
        return None, structure
    offsets, total = [], 0
    for array in arrays:
        offsets.append(total)
        total += -(-array.nbytes // 64) * 64  # 64-byte aligned
    block = blocks.take(total)
    for array, offset in zip(arrays, offsets, strict=True):
        np.ndarray(array.shape, array.dtype, buffer=block.buf, offset=offset)[...] = array

    def place(item):
        if _placeholder(item):
            return ("__array__", offsets[item[1]], item[2], item[3])
        if isinstance(item, tuple):
            return tuple(place(part) for part in item)
        if isinstance(item, dict):
            return {key: place(part) for key, part in item.items()}
        return item

    return block.name, place(structure)


def _unpack(block: shared_memory.SharedMemory | None, structure):
    """`_pack`'s value again, its arrays copied out of `block` (which goes back to its worker)."""

    def build(item):
        if _placeholder(item):
            _, offset, shape, dtype = item
            return np.ndarray(shape, np.dtype(dtype), buffer=block.buf, offset=offset).copy()
        if isinstance(item, tuple):
            return tuple(build(part) for part in item)
        if isinstance(item, dict):
            return {key: build(part) for key, part in item.items()}
        return item

    return build(structure)


def _worker(pickled: bytes, tasks, results) -> None:
    """A worker process: unpickle the dataset, then make `dataset.make_item(index)` for each task
    (an int); a str on the task pipe hands back a block, None stops."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the reader handles Ctrl-C and closes the pool
    warnings.filterwarnings("ignore", message="Skipped image file")  # the reader warns once it merges
    try:
        dataset = pickle.loads(pickled)
        results.send(("ready", os.getpid()))
    except BaseException as error:  # noqa: BLE001 - reported to the reader, which raises it
        results.send(("failed", None, _portable(error)))
        return
    blocks = _Blocks()
    try:
        while True:
            try:
                task = tasks.recv()
            except (EOFError, OSError):  # the reader is gone
                return
            if task is None:
                return
            if isinstance(task, str):
                blocks.release(task)
                continue
            try:
                name, structure = _pack(dataset.make_item(task), blocks)
                message = ("done", task, name, structure, _take_bad_images(dataset))
            except BaseException as error:  # noqa: BLE001 - reported to the reader, which raises it
                message = ("failed", task, _portable(error))
            try:
                results.send(message)
            except OSError:
                return
    finally:
        blocks.unlink_all()


def _portable(error: BaseException):
    """The exception if it pickles, else a `WorkerError` with its text; the traceback either way."""
    text = "".join(traceback.format_exception(error))
    try:
        pickle.loads(pickle.dumps(error))
        return error, text
    except Exception:  # noqa: BLE001 - any pickling failure
        return WorkerError(f"{type(error).__name__}: {error}"), text


class BatchPool:
    """`workers` processes making `dataset.make_item(index)`, read in any order with `get(index)`.

    `get(index)` also asks for the `ahead` items after it (for a dataset of known `length`, not past
    its end), so a reader going through the indices in turn finds them made. Thread-safe. The pool
    holds the dataset weakly (its `source.bad_images` strongly): it goes when the dataset goes.
    """

    def __init__(self, dataset, workers: int, ahead: int | None = None, length: int | None = None):
        self.workers = int(workers)
        self.ahead = 2 * self.workers if ahead is None else int(ahead)
        self.length = length
        pickled = pickle.dumps(dataset)  # here, so that a dataset that cannot travel says so at once
        self._dataset = weakref.ref(dataset)
        self._bad_images = getattr(getattr(dataset, "source", None), "bad_images", None)
        self._lock = threading.Condition()
        self._results: dict[int, tuple] = {}
        self._asked: set[int] = set()
        self._error: BaseException | None = None
        self._closed = False
        self._ready = threading.Event()
        self._processes: list = []
        self._tasks: list = []
        self._pipes: list = []
        self._next_worker = 0
        self._attached: dict[str, shared_memory.SharedMemory] = {}
        self._finalizer = weakref.finalize(
            self, BatchPool._shutdown, self._processes, self._tasks, self._results, self._attached
        )
        self._starter = threading.Thread(
            target=BatchPool._start,
            args=(weakref.ref(self), pickled),
            name="keras_vit-input-start",
            daemon=True,
        )
        self._starter.start()

    # -- start ---------------------------------------------------------------------------------
    @staticmethod
    def _start(pool_ref, pickled: bytes) -> None:
        pool = pool_ref()
        if pool is None:
            return
        try:
            context = _context()
            process_class = _process_class(context)
            for number in range(pool.workers):
                task_read, task_write = context.Pipe(duplex=False)
                result_read, result_write = context.Pipe(duplex=False)
                process = process_class(
                    target=_worker,
                    args=(pickled, task_read, result_write),
                    name=f"keras_vit-input-{number}",
                    daemon=True,
                )
                if pool._closed:
                    return
                process.start()
                pool._processes.append(process)
                pool._tasks.append(task_write)
                pool._pipes.append(result_read)
                task_read.close()
                result_write.close()
            for number, pipe in enumerate(pool._pipes):
                connection.wait([pipe, pool._processes[number].sentinel], timeout=600)
                try:
                    message = pipe.recv()
                except (EOFError, OSError):
                    raise WorkerError(pool._death(number, "while starting")) from None
                if message[0] == "failed":
                    error, text = message[2]
                    raise WorkerError(
                        f"Input worker {number} could not start (it unpickles the dataset: everything the "
                        f"source reads must be importable outside your script's __main__):\n{text}"
                    ) from error
        except BaseException as error:  # noqa: BLE001 - kept and raised in the reader
            with pool._lock:
                pool._error = pool._error or error
                pool._lock.notify_all()
            return
        threading.Thread(
            target=BatchPool._receive, args=(pool_ref,), name="keras_vit-input-read", daemon=True
        ).start()
        pool._ready.set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the workers are up (True), or for `timeout` s (False); raise if they failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready.wait(0.1):
            if self._error is not None:
                raise self._error
            if deadline is not None and time.monotonic() > deadline:
                return False
        return True

    def _death(self, number: int, when: str) -> str:
        process = self._processes[number]
        process.join(timeout=1)
        code = process.exitcode
        if code is not None and code < 0:
            how = f"killed by signal {-code} ({signal.Signals(-code).name})"
        else:
            how = f"exit code {code}"
        return (
            f"Input worker process {number} (pid {process.pid}) died {when}: {how} (out of memory, killed, "
            "or a crash in native code). The input cannot go on; rerun with fewer workers, or workers=0 "
            "to make the batches in the training process."
        )

    # -- results -------------------------------------------------------------------------------
    @staticmethod
    def _receive(pool_ref) -> None:
        """Read results from every worker; a worker that dies sets the pool's error."""
        pool = pool_ref()
        if pool is None:
            return
        sentinels = {process.sentinel: number for number, process in enumerate(pool._processes)}
        pipes = {pipe: number for number, pipe in enumerate(pool._pipes)}
        closed = pool._finalizer  # alive while the pool is
        del pool
        while True:
            pool = pool_ref()
            if pool is None or pool._closed or not closed.alive:
                return
            ready = connection.wait([*pipes, *sentinels], timeout=0.5)
            for item in ready:
                if item not in pipes:
                    continue
                try:
                    message = item.recv()
                except (EOFError, OSError):
                    del pipes[item]  # the worker is gone: its sentinel says how
                    continue
                with pool._lock:
                    if message[0] == "done":
                        pool._results[message[1]] = (pipes[item], *message[2:])
                    else:
                        error, text = message[2]
                        error.add_note(f"In input worker {pipes[item]}:\n{text}")
                        pool._error = pool._error or error
                    pool._lock.notify_all()
            for item in ready:
                number = sentinels.get(item)
                if (
                    number is None
                    or pool._closed
                    or pool._pipes[number] in pipes
                    and pool._pipes[number].poll()
                ):
                    continue  # a dead worker's last results are read first
                with pool._lock:
                    pool._error = pool._error or WorkerError(pool._death(number, "while making batches"))
                    pool._lock.notify_all()
                return
            del pool

    def _ask(self, index: int) -> None:
        """Send item `index` to the next worker (under the lock)."""
        if index in self._asked or (self.length is not None and index >= self.length):
            return
        number = self._next_worker
        try:
            self._tasks[number].send(index)
        except OSError:
            raise WorkerError(self._death(number, "while making batches")) from None
        self._asked.add(index)
        self._next_worker = (number + 1) % self.workers

    def get(self, index: int):
        """Item `index`: from the workers once they are ready, else made here (the same item)."""
        index = int(index)
        if self._error is not None:
            raise self._error
        if not self._ready.is_set():
            return self._dataset().make_item(index)
        with self._lock:
            for ahead in range(self.ahead + 1):
                self._ask(index + ahead)
            while index not in self._results:
                if self._error is not None:
                    raise self._error
                if self._closed:
                    raise WorkerError("The input's worker pool is closed.")
                self._lock.wait(timeout=1.0)
            number, name, structure, record = self._results.pop(index)
            self._asked.discard(index)
            item = _unpack(self._attach(name), structure)
            self._release(number, name)
            # Items made for a reader that has since jumped back are dropped.
            for stale in [key for key in self._results if key < index - self.ahead]:
                self._release(*self._results.pop(stale)[:2])
                self._asked.discard(stale)
        if record is not None and self._bad_images is not None:
            _merge_bad_images(self._bad_images, record)
        return item

    def _attach(self, name: str | None) -> shared_memory.SharedMemory | None:
        """The worker's block `name`, mapped here once (the workers reuse their blocks)."""
        if name is not None and name not in self._attached:
            self._attached[name] = shared_memory.SharedMemory(name=name)
        return self._attached.get(name)

    def _release(self, number: int, name: str | None) -> None:
        """Hand block `name` back to worker `number` (under the lock)."""
        if name is not None:
            try:
                self._tasks[number].send(name)
            except OSError:
                pass  # a dead worker: the pool's error says so

    # -- shutdown ------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the workers (idempotent): items made but not read are discarded."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        if self._starter is not threading.current_thread():
            self._starter.join(timeout=60)
        self._finalizer()

    @staticmethod
    def _shutdown(processes: list, tasks: list, results: dict, attached: dict) -> None:
        for pipe in tasks:
            try:
                pipe.send(None)
            except OSError:
                pass
        for process in processes:
            process.join(timeout=2)
            if process.is_alive():
                process.terminate()
                process.join(timeout=2)
            if process.is_alive():
                process.kill()
                process.join()
        for pipe in tasks:
            pipe.close()
        results.clear()
        for block in attached.values():  # the workers unlinked theirs; a killed one's are left
            block.close()
            try:
                block.unlink()
            except FileNotFoundError:
                pass
        attached.clear()


class PooledItems:
    """A mixin for `keras.utils.PyDataset`s whose item `i` is a pure function of `i`, `make_item(i)`:
    made in `processes` worker processes (`BatchPool`, started on the first read) if > 0, else by
    the reader. A dataset that cannot be pickled (a source reading through a lambda) is read by
    the reader, with one warning. The pool is not pickled: a worker's copy makes its items itself.
    """

    processes: int = 0
    pool_length: int | None = None
    _pool: BatchPool | None = None

    def make_item(self, index: int):  # pragma: no cover - the class using the mixin defines it
        raise NotImplementedError

    def __getitem__(self, index: int):
        if not self.processes:
            return self.make_item(index)
        if self._pool is None:
            try:
                self._pool = BatchPool(self, self.processes, length=self.pool_length)
            except (pickle.PicklingError, TypeError, AttributeError) as error:
                warnings.warn(
                    f"The input's worker processes need a dataset that pickles ({error}): its batches "
                    "are made in this process instead (slower). Read files through module-level functions.",
                    stacklevel=2,
                )
                self.processes = 0
                return self.make_item(index)
            weakref.finalize(self, self._pool.close)
        return self._pool.get(index)

    @property
    def pool(self) -> BatchPool | None:
        """The running worker pool, if any (tests and benchmarks wait for it: `pool.wait_ready()`)."""
        return self._pool

    def close(self) -> None:
        """Stop the worker processes, if any (they also stop at exit and with the dataset)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_pool"] = None
        state["processes"] = 0
        return state
