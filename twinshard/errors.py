"""One error wrapper for every command line: a ValueError or OSError becomes one message on
stderr and exit status 1 (`--debug` or TWINSHARD_DEBUG=1 shows the traceback)."""

from __future__ import annotations

import os
import sys
from typing import Callable


def guarded(main: Callable, *args, debug: bool = False, name: str | None = None):
    """Run main(*args), ending with os._exit after flushing (measured: a failed Orbax read leaves
    tensorstore callbacks that print 'Event loop is closed' tracebacks at interpreter shutdown)."""
    try:
        return main(*args)
    except (ValueError, OSError) as e:
        if debug or os.environ.get("TWINSHARD_DEBUG", "0") not in ("", "0"):
            raise
        sys.stdout.flush()
        prog = name or os.path.basename(sys.argv[0])
        message = f"{prog}: error: {e}\n(for the traceback, add --debug or set TWINSHARD_DEBUG=1)\n"
        # send fd 2 and sys.stderr to /dev/null first; the message goes to a private copy of stderr
        sys.stderr.flush()
        own = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        sys.stderr = open(os.devnull, "w")
        os.write(own, message.encode())
        os._exit(1)
