"""A stand-in for the training process of a multi-process run, under `keras_vit.utils.supervisor`.

`supervised_worker.py ADDRESS INDEX COLLECTIVE_PORT [abort|fail|finish]`: agrees with its partner
(`keras_vit.training.runs.agreement`, which hands the connection to the supervisor), then waits in
a "collective": a second connection to the partner, as gloo's. When the partner dies that
connection resets and this process ends as gloo ends one (`abort`: a C++ message and SIGABRT) or
as a collective's error does (`fail`: the driver's lost-connection line, exit status 1); with
`finish` both end well, process 1 first.
"""

import importlib.util
import os
import socket
import sys
import time

import keras_vit
from keras_vit.utils import supervisor

supervisor.attach()
# agreement.py alone, without its package (which imports Keras): a second to start, not ten
_path = os.path.join(os.path.dirname(keras_vit.__file__), "training", "runs", "agreement.py")
_spec = importlib.util.spec_from_file_location("agreement", _path)
agreement = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(agreement)
agree = agreement.agree

address, index, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
how = sys.argv[4] if len(sys.argv) > 4 else "abort"
partners = agree(address, 2, index, {"seed": 0}, wait=60)
if how == "finish":  # the run ends well: process 1 at once, process 0 two seconds later
    print(f"training {os.getpid()}", flush=True)
    time.sleep(2 * (index == 0))
    partners.finish()
    sys.exit(0)
if index == 0:
    with socket.create_server(("localhost", port)) as server:
        peer, _ = server.accept()
else:
    deadline = time.monotonic() + 60
    while True:
        try:
            peer = socket.create_connection(("localhost", port))
            break
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.1)
try:
    print(f"training {os.getpid()}", flush=True)
    peer.recv(1)  # blocks while the partner lives
except OSError:
    pass
except KeyboardInterrupt:  # as `keras-vit` ends on Ctrl-C (keras_vit.cli.main)
    print("keras-vit: interrupted", file=sys.stderr)
    sys.exit(130)
if how == "abort":
    sys.stderr.write(
        "terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
        "  what():  [gloo/transport/tcp/pair.cc:538] Read error [127.0.0.1]:4242: Connection reset by peer\n"
    )
    sys.stderr.flush()
    os.abort()
print(
    "keras-vit: error: Another process of this multi-process run stopped (its connection was lost: "
    "Connection reset by peer), so this one stops too.",
    file=sys.stderr,
)
sys.exit(1)
