"""`keras-vit`: the command line (`keras_vit.cli:main`).

`parser` declares the commands and their flags (the training commands' generated from
`keras_vit.training.options`), `startup` imports the backend in a safe order and turns errors into one
line, `commands` does each job. Importing this package imports nothing heavy.
"""

from __future__ import annotations

import sys

from keras_vit.cli.parser import build_parser
from keras_vit.cli.startup import error_message, load_backend
from keras_vit.utils import supervisor
from keras_vit.utils.environment import enable_onednn

__all__ = ["build_parser", "main"]


def main(argv: list[str] | None = None) -> int:
    """Run `keras-vit ARGV`; return the exit status (a failure: one `keras-vit: error:` line, 1)."""
    supervisor.attach()  # in the training process of a multi-process run: its supervisor is the parent
    args = build_parser().parse_args(argv)
    enable_onednn()  # before TensorFlow is imported, by this command or later in the process
    try:
        if getattr(args, "check", None):
            args.check(args)  # the command's checks that need no backend: an error in a fraction of a second
        processes = getattr(args, "multi_process", None)
        if processes is not None and not args.debug and not supervisor.handing_over():
            # the training in a child process: a partner dying cannot abort this one (`supervisor`)
            return supervisor.run(sys.argv[1:] if argv is None else list(argv), processes.process_id)
        if getattr(args, "needs_backend", True):
            load_backend(args.debug)
        return args.run(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("keras-vit: interrupted", file=sys.stderr)
        return 130  # as a shell reports a process stopped by Ctrl-C (SIGINT)
    except Exception as error:
        if args.debug:
            raise
        print(f"keras-vit: error: {error_message(error)}", file=sys.stderr)
        return 1
