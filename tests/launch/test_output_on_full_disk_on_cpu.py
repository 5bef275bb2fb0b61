"""The SLURM job driver copies the launcher's output to output.log: a full disk there must not stall the launcher."""

from __future__ import annotations

import sys

from restage.launch.job import _Launched


def test_output_keeps_flowing_when_output_log_cannot_grow(small_tmpfs):
    disk = small_tmpfs(64 * 1024)
    # 2 MB of output, 30 times the disk: the pipe would fill (and the child block) if the copy stopped.
    child = "import sys\nfor i in range(20000): print(f'line {i:06d} ' + 'x' * 90)\nprint('last line')"
    launched = _Launched([sys.executable, "-c", child], env={}, log_path=disk / "output.log")
    assert launched.done.wait(60) and launched.returncode == 0
    assert launched.tail[-1] == b"last line\n"
    assert (disk / "output.log").read_bytes().startswith(b"line 000000 ")
