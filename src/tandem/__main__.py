import os
import sys

from tandem.cli import app
from tandem.distributed.torchrun import under_torchrun

if under_torchrun():
    # A rank started by torchrun leaves through os._exit once its command has returned and
    # flushed its output: the interpreter's own teardown, after destroy_process_group, can
    # abort the process in native code ("terminate called without an active exception", about
    # one run in seven here), which torchrun reports as a failed job although every result was
    # written.
    try:
        app(prog_name="tandem")
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
else:
    app(prog_name="tandem")
