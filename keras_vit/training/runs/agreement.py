"""Processes agree before they train: one exchange of every process's run arguments, in plain Python.

Before JAX joins the processes of a multi-process run (`keras_distribution.join_processes`),
process 0 listens on the coordinator's port for a while (`wait` seconds) and every other process
connects and sends its process id, host, pid and run arguments. Process 0 compares them and
answers every process with the same verdict, so that a run whose processes differ (another
`--seed`, `--batch-size`, `--steps`, `--output-dir`, ...), a process id given twice, a process
that never comes or a coordinator that cannot be reached stops every process with one error
naming the argument or the address, within `wait` seconds, instead of hanging in (or aborting
from) a collective. Then process 0 closes the port and JAX's coordination service takes it.

The connections stay open while the run lasts (`Partners`): when a process ends before saying it
finished (killed, SIGTERM, an error), the others see its connection close and stop within
seconds with one line naming it, instead of waiting in a collective for JAX's heartbeat to abort
them (process 0 tells the others which process stopped). Under `keras-vit`'s supervisor
(`keras_vit.utils.supervisor`) the supervisor watches them instead, out of reach of the native
aborts of JAX and gloo.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time

from keras_vit.utils import supervisor

__all__ = ["Partners", "ProcessesDisagreeError", "agree"]

_RETRY_SECONDS = 0.2
# How long a process whose partner vanished lets its own error (often the same one) be reported first.
_GRACE_SECONDS = 1.0
_DONE = b"done\n"
_FAILED = b"failed\n"


def _who(hello: dict) -> str:
    return f"pid {hello['pid']} on {hello['host']}"


class ProcessesDisagreeError(RuntimeError):
    """The processes of a multi-process run cannot train together (the message says why)."""


def _split(address: str) -> tuple[str, int]:
    """Process 0's (host, port) from `HOST:PORT` or Keras's comma-separated list (its first entry)."""
    host, _, port = address.split(",")[0].strip().rpartition(":")
    return host.strip("[]"), int(port)


def _send(connection: socket.socket, message: dict) -> None:
    connection.sendall(json.dumps(message).encode("utf-8") + b"\n")


def _receive(connection: socket.socket, deadline: float) -> dict | None:
    """One JSON line from `connection` before `deadline` (`None`: closed or too late)."""
    data = b""
    while not data.endswith(b"\n"):
        connection.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            chunk = connection.recv(65536)
        except (TimeoutError, OSError):
            return None
        if not chunk:
            return None
        data += chunk
    try:
        message = json.loads(data)
    except ValueError:
        return None
    return message if isinstance(message, dict) else None


def _differences(hellos: dict[int, dict], names: dict[str, str]) -> str | None:
    """The first sentence naming the arguments the processes disagree on, or `None`."""
    keys = sorted({key for hello in hellos.values() for key in hello["run"]})
    differing = [key for key in keys if len({json.dumps(h["run"].get(key)) for h in hellos.values()}) > 1]
    if not differing:
        return None
    parts = []
    for key in differing:
        values = ", ".join(f"{hellos[index]['run'].get(key)!r} (process {index})" for index in sorted(hellos))
        parts.append(f"{names.get(key, key)}: {values}")
    return (
        f"The processes of this run were started with different arguments: {'; '.join(parts)}. Start every "
        "process with the same arguments (only --process-id differs)."
    )


def _chief(host: str, port: int, count: int, own: dict, names: dict[str, str], wait: float) -> Partners:
    """Process 0: collect every other process's hello, compare, answer each with the verdict."""
    dual = socket.has_dualstack_ipv6()  # both localhost spellings (::1, 127.0.0.1) reach it
    try:
        server = socket.create_server(
            ("", port), family=socket.AF_INET6 if dual else socket.AF_INET, dualstack_ipv6=dual
        )
    except OSError as error:
        raise ProcessesDisagreeError(
            f"Process 0 cannot listen on port {port} of the coordinator {host}:{port} "
            f"({os.strerror(error.errno) if error.errno else error}): "
            "another process 0 of this run uses it (was --process-id 0 given twice?) or another program "
            "does. Give each process its own --process-id, or choose another free port for --coordinator."
        ) from None
    hellos: dict[int, dict] = {0: own}
    connections: list[tuple[socket.socket, int]] = []
    duplicates: list[str] = []
    deadline = time.monotonic() + wait
    verdict = None
    with server:
        while len(hellos) < count and time.monotonic() < deadline:
            server.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                connection, _ = server.accept()
            except (TimeoutError, OSError):
                break
            hello = _receive(connection, deadline)
            if hello is None or not isinstance(hello.get("process_id"), int) or "run" not in hello:
                connection.close()  # not one of ours (a port scan, a stray client)
                continue
            index = hello["process_id"]
            connections.append((connection, index))
            if index in hellos:
                first = hellos[index]
                duplicates.append(
                    f"--process-id {index} was given to two processes (pid {first['pid']} on {first['host']} "
                    f"and pid {hello['pid']} on {hello['host']})"
                )
            else:
                hellos[index] = hello
        missing = sorted(set(range(count)) - set(hellos))
        if duplicates:
            verdict = f"{'; '.join(duplicates)}: give each process its own --process-id, 0 to {count - 1}."
        elif missing:
            verdict = (
                f"Process(es) {', '.join(map(str, missing))} of the {count} did not join within {wait:g} s "
                f"(coordinator {host}:{port}): start every process (--process-id 0 to {count - 1}) within "
                "that time (--join-timeout), each with --coordinator naming this address."
            )
        else:
            counts = {index: hello["num_processes"] for index, hello in hellos.items()}
            if len(set(counts.values())) > 1:
                listed = ", ".join(f"{value} (process {index})" for index, value in sorted(counts.items()))
                verdict = f"The processes of this run were given different --num-processes: {listed}."
            else:
                verdict = _differences(hellos, names)
        who = {index: _who(hello) for index, hello in hellos.items()}
        for connection, _ in connections:
            try:
                _send(connection, {"error": verdict, "who": {str(k): v for k, v in who.items()}})
                if verdict:
                    _receive(connection, time.monotonic() + 5)  # the process closes first: no TIME_WAIT here
            except OSError:
                pass
            if verdict:
                connection.close()
    if verdict:
        raise ProcessesDisagreeError(verdict)
    return Partners({index: connection for connection, index in connections}, who, index=0)


def _worker(host: str, port: int, hello: dict, wait: float) -> Partners:
    """Any other process: reach process 0 within `wait`, send the hello, read the verdict."""
    deadline = time.monotonic() + wait
    reason = "no answer"
    while True:
        try:
            connection = socket.create_connection(
                (host, port), timeout=max(deadline - time.monotonic(), 0.01)
            )
            break
        except OSError as error:
            reason = error.strerror or type(error).__name__
            if time.monotonic() + _RETRY_SECONDS >= deadline:
                raise ProcessesDisagreeError(
                    f"Cannot reach process 0 at the coordinator {host}:{port} within {wait:g} s ({reason}): "
                    "start process 0 (--process-id 0) on that machine, check the address and that the port "
                    "is open, or wait longer (--join-timeout)."
                ) from None
            time.sleep(_RETRY_SECONDS)
    _send(connection, hello)
    answer = _receive(connection, deadline + wait)  # process 0 waits `wait` for the others first
    if answer is None or answer.get("error"):
        connection.close()
    if answer is None:
        raise ProcessesDisagreeError(
            f"Process 0 at {host}:{port} did not answer within {2 * wait:g} s: it stopped, or it is not a "
            "keras_vit run of this version."
        )
    if answer.get("error"):
        raise ProcessesDisagreeError(str(answer["error"]))
    who = {int(k): v for k, v in answer.get("who", {}).items() if str(k).isdigit()}
    return Partners({0: connection}, who, index=hello["process_id"])


class Partners:
    """The open connections to the run's other processes (process 0: to every other; others: to 0).

    Each is watched by a thread: a partner that closes its connection without saying `finish`
    (or that process 0 reports lost) ends this process (one line on stderr naming the process
    that stopped, exit status 1) after a short grace, so that no process waits for a dead one;
    process 0 first tells the others which one stopped. `finish()` says this process is done and
    stops watching. In a child of `keras_vit.utils.supervisor` the supervisor takes the
    connections and does all this itself.
    """

    def __init__(
        self, connections: dict[int, socket.socket], who: dict[int, str] | None = None, index: int = 0
    ):
        self._finished = threading.Event()
        self._who, self._index = who or {}, index
        if supervisor.handing_over():
            supervisor.hand_over(connections, self._who)
            connections = {}
        self._connections = connections
        for partner, connection in connections.items():
            connection.settimeout(None)
            threading.Thread(target=self._watch, args=(partner, connection), daemon=True).start()

    def _watch(self, partner: int, connection: socket.socket) -> None:
        lost = supervisor.partner_news(connection, partner)
        if lost is None or self._finished.is_set():
            return
        for other, connection in self._connections.items():  # process 0 tells the others who stopped
            if other not in (partner, lost):
                with contextlib.suppress(OSError):
                    connection.sendall(f"lost {lost}\n".encode())
        time.sleep(_GRACE_SECONDS)
        if self._finished.is_set():
            return
        prefix = "keras-vit" if "keras_vit.cli" in sys.modules else "keras_vit"
        print(supervisor.stopped_line(prefix, lost, self._who, self._index), file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)

    def fail(self) -> None:
        """This process's run stopped with an error of its own: the partners hear `failed` first, so a
        refusal every process meets is reported by each in its own words."""
        self._tell(_FAILED)

    def finish(self) -> None:
        """This process's run ended well: tell the partners, stop watching them."""
        self._finished.set()
        supervisor.finished()
        self._tell(_DONE)

    def _tell(self, message: bytes) -> None:
        for connection in self._connections.values():
            with contextlib.suppress(OSError):
                connection.sendall(message)


def agree(
    address: str, count: int, index: int, run: dict, names: dict[str, str] | None = None, wait: float = 30
) -> Partners:
    """The connections to the other processes of the run at `address` (process 0's HOST:PORT), watched.

    `ProcessesDisagreeError` (the same in every process) unless all `count` processes come within
    `wait` seconds, each with its own `index`, and agree on `run` (the JSON-able arguments that must
    be equal; `names`: how to call each key, e.g. its flag)."""
    host, port = _split(address)
    hello = {
        "process_id": index,
        "num_processes": count,
        "host": socket.gethostname(),
        "pid": supervisor.supervisor_pid(),  # the process the user started
        "run": json.loads(json.dumps(run, default=lambda value: f"<{type(value).__name__}>")),
    }
    if index == 0:
        return _chief(host, port, count, hello, names or {}, wait)
    return _worker(host, port, hello, wait)
