"""Faults that tests inject into real processes and connections."""
from __future__ import annotations

import os
import signal
import subprocess

REAP_TIMEOUT_S = 10.0


# --- Crashes -------------------------------------------------------------------
def kill_hard(process: subprocess.Popen) -> None:
    """SIGKILL a process (its whole process group when it leads one: nothing
    it started survives) and reap it. No handler runs: no finally, no
    settlement, no release, as when a machine loses power."""
    if process.poll() is None:
        try:
            if os.getpgid(process.pid) == process.pid:
                os.killpg(process.pid, signal.SIGKILL)
            else:
                process.kill()
        except ProcessLookupError:  # it exited meanwhile
            pass
    process.wait(REAP_TIMEOUT_S)
