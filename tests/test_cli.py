"""cli.py: typer commands as thin wrappers; what a user can fix is one line and exit 2, Ctrl-C 130, SIGTERM 143."""

import errno
import os
import signal
import subprocess
import sys
import time

import pytest

from fluxtrt.cli import _one_line
from fluxtrt.errors import FluxtrtError


@pytest.mark.parametrize("error,says", [
    (FluxtrtError("two\nlines"), "two lines"),
    (MemoryError(), "out of memory; try `--low-vram`"),
    (RuntimeError("CUDA out of memory. Tried to allocate"), "out of GPU memory"),
    (OSError(errno.ENOSPC, "No space left", "x.engine"), "no space left on the device while writing x.engine"),
    (OSError(errno.EACCES, "Permission denied", "/root/x"), "cannot write /root/x: Permission denied"),
])
def test_what_the_user_can_fix_is_one_line(error, says):
    line = _one_line(error)
    assert line is not None and says in line and "\n" not in line


def test_a_bug_keeps_its_traceback():
    assert _one_line(KeyError("x")) is None and _one_line(ValueError("x")) is None


def test_sigterm_stops_a_command_like_ctrl_c_with_exit_143():
    """The entry point turns SIGTERM into the Ctrl-C path: one line, cleanup on the way out, exit 143."""
    code = ("import sys, time, fluxtrt.cli as c\n"
            "@c.app.command()\n@c.friendly\ndef wait():\n    print('ready', flush=True)\n    time.sleep(60)\n"
            "sys.argv = ['fluxtrt', 'wait']\nc.run_cli()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.stdout.readline().strip() == "ready"
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 143 and "stopped by SIGTERM" in out and "Traceback" not in out, out
    assert time.time() - t0 < 10
