"""A process of a multi-process `keras-vit` run: the training in a child process, the partners watched here.

When a process of a multi-process JAX run dies, the others cannot always say so themselves: JAX's
coordination client aborts a process whose process 0 vanished, and gloo aborts one whose partner
died inside a collective (SIGABRT and a C++ stack trace, before Python runs again). So the
training commands run a multi-process run's training in a child process (`run`) and stay as its
supervisor, which imports nothing heavy and cannot be aborted that way:

* after the processes agree (`keras_vit.training.runs.agreement`) the child hands its connections
  to the other processes over to the supervisor (`hand_over`), which watches them: a partner
  whose connection closes before it said `done` (or that process 0 reports lost) stops the child
  at once (SIGKILL: the backups are written atomically, the last complete one stays) and the
  supervisor prints one `keras-vit: error:` line naming that process;
* the child's stderr passes through the supervisor: lines that may start a crash report (a C++
  log or stack trace, `terminate called`, a Python traceback, an error line) are held for a
  second, and dropped when the child ended because a partner died (then the one line says why);
  otherwise they are printed as they are;
* the child dies with its supervisor (Linux `PR_SET_PDEATHSIG`, and a thread watching the
  channel), SIGTERM, SIGHUP and SIGINT are passed on to it, and the supervisor ends as the child did.
  The child has a process group of its own, so a terminal's Ctrl-C (SIGINT to the foreground group)
  reaches it once, through the supervisor, as does a SIGINT sent to the supervisor's pid alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

__all__ = ["SUPERVISOR_VARIABLE", "attach", "finished", "hand_over", "handing_over", "run"]

# How a child finds its supervisor: "FD:PID" (the channel's file descriptor, the supervisor's pid).
SUPERVISOR_VARIABLE = "KERAS_VIT_SUPERVISOR"
# How long a supervisor whose child was aborted waits for news that a partner died first.
_GRACE_SECONDS = 5.0
# How long lines that may start a crash report are held back while the child lives.
_HOLD_SECONDS = 1.0
_SUSPECT = re.compile(
    rb"^(terminate called|  what\(\):|[EFW]\d{4} \d\d:\d\d:\d\d|\*\*\* |    @ |Fatal Python error|"
    rb"Traceback|Current thread|Thread 0x|Extension modules:|keras-vit: error:|keras_vit: error:)"
)
# What the child prints when a collective noticed the lost partner first (`ends_together`).
_LOST_LINE = b"Another process of this multi-process run stopped"
_OWN_ERROR = re.compile(rb"^keras[-_]vit: error:")
# How long a child whose partner stopped with an error of its own may take to meet its own.
_OWN_ERROR_SECONDS = 3.0
_STOPPED_BY = {signal.SIGTERM, signal.SIGHUP, signal.SIGINT}

# In a supervised child: the channel to the supervisor (`attach`).
_channel: socket.socket | None = None
_supervisor_pid: int | None = None


def attach() -> None:
    """In a child started by `run`: find the supervisor, and die with it (no-op elsewhere)."""
    global _channel, _supervisor_pid
    value = os.environ.pop(SUPERVISOR_VARIABLE, None)
    if not value or _channel is not None:
        return
    fd, pid = (int(part) for part in value.split(":"))
    _channel, _supervisor_pid = socket.socket(fileno=fd), pid
    _channel.set_inheritable(False)  # the channel closes when this process ends, not its children
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != pid:  # the supervisor died before the line above
        os._exit(1)
    # a SIGINT reaches this process only through the supervisor, which stops the run with it: honoured
    # even where it was ignored when the command started (a script's background job)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Thread(target=_die_with_supervisor, args=(_channel,), daemon=True).start()


def _die_with_supervisor(channel: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while channel.recv(64):
            pass
    os._exit(1)


def handing_over() -> bool:
    """Whether this process is a supervised child (its partners are watched by the supervisor)."""
    return _channel is not None


def supervisor_pid() -> int:
    """The pid the user started: the supervisor's in a supervised child, else this process's."""
    return _supervisor_pid or os.getpid()


def hand_over(connections: dict[int, socket.socket], who: dict[int, str]) -> None:
    """Give the connections to the other processes (by process index) to the supervisor, and close
    them here; `who` says how to name each process (its pid and host)."""
    indices = sorted(connections)
    message = json.dumps({"partners": indices, "who": {str(k): v for k, v in who.items()}}).encode() + b"\n"
    socket.send_fds(_channel, [message], [connections[index].fileno() for index in indices])
    for connection in connections.values():
        connection.close()


def finished() -> None:
    """The supervised child's run ended well: the supervisor tells the partners (`done`)."""
    if _channel is not None:
        with contextlib.suppress(OSError):
            _channel.sendall(b"done\n")


def partner_news(
    connection: socket.socket, index: int, on_failed: Callable[[], None] | None = None
) -> int | None:
    """Block until partner `index` says `done` (`None`), or the index of the process that stopped:
    `index` when its connection closes first, `k` when it says `lost k` (process 0 relaying).
    `on_failed` is called when the partner says `failed` (its run stopped with an error of its own)."""
    buffer = b""
    while True:
        try:
            chunk = connection.recv(256)
        except OSError:
            return index
        if not chunk:
            return index
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            if line == b"done":
                return None
            if line == b"failed" and on_failed is not None:
                on_failed()
            if line.startswith(b"lost ") and line[5:].isdigit():
                return int(line[5:])


def stopped_line(prefix: str, lost: int, who: dict[int, str], index: int) -> str:
    """The one line of a process that stops because process `lost` did."""
    named = f" ({who[lost]})" if lost in who else ""
    return (
        f"{prefix}: error: process {lost}{named} of this multi-process run stopped before the run ended "
        f"(killed, interrupted or failed: see its output), so process {index} stopped too. The last "
        "complete backup is kept: start every process again with the same arguments to resume."
    )


class _Supervisor:
    def __init__(self, index: int):
        self.index = index
        self.partners: dict[int, socket.socket] = {}
        self.who: dict[int, str] = {}
        self.lost: int | None = None
        self.partner_failed = False  # a partner said its run stopped with an error of its own
        self.news = threading.Event()
        self.done = threading.Event()
        self.lock = threading.Lock()
        self.held: list[bytes] = []
        self.held_since: float | None = None
        self.lost_line = False

    # the child's stderr
    def pump(self, stream) -> None:
        for line in iter(stream.readline, b""):
            with self.lock:
                if self.held_since is None and not _SUSPECT.match(line):
                    _write(line)
                    continue
                if self.held_since is None:
                    self.held_since = time.monotonic()
                self.held.append(line)
                self.lost_line = self.lost_line or _LOST_LINE in line

    def release(self, force: bool = False) -> None:
        """Print the held lines once they are old enough (the child lives on: no crash report)."""
        with self.lock:
            if self.held_since is not None and (force or time.monotonic() - self.held_since > _HOLD_SECONDS):
                for line in self.held:
                    _write(line)
                self.held, self.held_since, self.lost_line = [], None, False

    # the channel from the child, then the partners
    def listen(self, channel: socket.socket) -> None:
        buffer, adopted = b"", False
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(channel, 65536, 256)
            except OSError:
                return
            if not data:
                return
            if fds and not adopted:
                adopted = True
                line, _, rest = data.partition(b"\n")
                message = json.loads(line)
                self.who = {int(k): v for k, v in message["who"].items()}
                for index, fd in zip(message["partners"], fds, strict=True):
                    connection = socket.socket(fileno=fd)
                    connection.setblocking(True)  # the child's sockets had timeouts (non-blocking)
                    _keepalive(connection)
                    self.partners[index] = connection
                for index, connection in list(self.partners.items()):
                    threading.Thread(target=self.watch, args=(index, connection), daemon=True).start()
                data = rest
            buffer += data
            if b"done\n" in buffer:
                self.done.set()
                self.tell(b"done\n")

    def watch(self, index: int, connection: socket.socket) -> None:
        lost = partner_news(connection, index, on_failed=self._partner_failed)
        if lost is None or self.done.is_set():
            return
        with self.lock:
            if self.lost is not None:
                return
            self.lost = lost
        for other, partner in self.partners.items():  # process 0 tells the others who stopped
            if other not in (index, lost):
                with contextlib.suppress(OSError):
                    partner.sendall(f"lost {lost}\n".encode())
        self.news.set()

    def _partner_failed(self) -> None:
        self.partner_failed = True

    def own_error(self) -> bool:
        """Whether the child ended with an error of its own: a held `keras-vit: error:` line that is not
        the line saying another process stopped."""
        with self.lock:
            return not self.lost_line and any(_OWN_ERROR.match(line) for line in self.held)

    def tell(self, message: bytes) -> None:
        for connection in self.partners.values():
            with contextlib.suppress(OSError):
                connection.sendall(message)

    def close(self) -> None:
        for connection in self.partners.values():
            with contextlib.suppress(OSError):
                connection.close()


def _write(line: bytes) -> None:
    with contextlib.suppress(OSError):
        sys.stderr.buffer.write(line)
        sys.stderr.buffer.flush()


def _keepalive(connection: socket.socket) -> None:
    """Notice a partner whose machine vanished (no FIN) within about 20 s."""
    with contextlib.suppress(OSError, AttributeError):
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 5)
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 3)
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 5)


def run(argv: list[str], index: int, prefix: str = "keras-vit", program: list[str] | None = None) -> int:
    """`python -m keras_vit.cli ARGV` (or `program` + ARGV) as process `index` of a multi-process run,
    supervised (module docstring); returns the exit status this process should end with."""
    ours, theirs = socket.socketpair()
    env = {**os.environ, SUPERVISOR_VARIABLE: f"{theirs.fileno()}:{os.getpid()}"}
    child = subprocess.Popen(
        [*(program or [sys.executable, "-m", "keras_vit.cli"]), *argv],
        env=env,
        pass_fds=(theirs.fileno(),),
        stderr=subprocess.PIPE,
        start_new_session=True,  # signals reach it through the supervisor only (module docstring)
    )
    theirs.close()
    supervisor = _Supervisor(index)
    forwarded = {}
    for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        forwarded[number] = signal.signal(number, lambda number, _: child.send_signal(number))
    pump = threading.Thread(target=supervisor.pump, args=(child.stderr,), daemon=True)
    pump.start()
    listener = threading.Thread(target=supervisor.listen, args=(ours,), daemon=True)
    listener.start()
    try:
        while child.poll() is None:
            if supervisor.news.wait(0.1):
                if supervisor.partner_failed:  # an error every process meets ends this one too, with its line
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        child.wait(_OWN_ERROR_SECONDS)
                child.kill()  # a partner died: stop now (the last complete backup stays)
                break
            supervisor.release()
        status = child.wait()
        pump.join(5)
        listener.join(5)  # the child's last words (`done`) reach the partners before the connections close
        if status == 0:
            supervisor.release(force=True)
            return 0
        own_error = status == 1 and supervisor.own_error()
        if own_error and supervisor.lost is None:
            supervisor.tell(b"failed\n")  # the partners wait a moment for their own error, if they meet it
        if own_error and supervisor.partner_failed:
            supervisor.release(force=True)  # the same refusal as its partner's: its own line
            return 1
        aborted = status == -signal.SIGABRT or supervisor.lost_line or supervisor.news.is_set()
        if aborted:
            supervisor.news.wait(_GRACE_SECONDS)
        if supervisor.lost is not None:
            with supervisor.lock:
                supervisor.held, supervisor.held_since = [], None  # the crash report of the lost partner
            print(stopped_line(prefix, supervisor.lost, supervisor.who, index), file=sys.stderr, flush=True)
            return 1
        supervisor.release(force=True)
        if status < 0 and -status == signal.SIGKILL:
            print(
                f"{prefix}: error: the training process of process {index} (pid {child.pid}) was killed "
                "(SIGKILL; out of memory?). The last complete backup is kept: start every process again "
                "with the same arguments to resume.",
                file=sys.stderr,
                flush=True,
            )
        if status < 0 and -status in _STOPPED_BY:
            supervisor.close()
            for number, handler in forwarded.items():
                signal.signal(number, handler)
            signal.signal(-status, signal.SIG_DFL)
            os.kill(os.getpid(), -status)  # end as the child did
        return status if status > 0 else 128 - status
    finally:
        supervisor.close()
        if child.poll() is None:
            child.kill()
            child.wait()
