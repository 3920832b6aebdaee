"""The benchmarks' child processes: started, waited for, stopped; at a lower CPU priority when asked."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from duplexd.bench.server import child_process


def _nice(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[16])  # (stat's 19th field: the 17th after the command name)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc to read a niceness")
@pytest.mark.parametrize("niceness", [0, 19])
def test_a_child_runs_at_the_niceness_asked_for(niceness: int) -> None:
    """A remote model beside the voice server (bench voice --remote-llm) yields the CPU: its process runs
    at nice 19; unasked, a child runs at this process's own priority."""
    cmd = [sys.executable, "-c", "import time; time.sleep(30)"]
    with child_process(cmd, name="sleeper", up=lambda: None, niceness=niceness) as proc:
        assert _nice(proc.pid) == min(19, _nice(os.getpid()) + niceness)
    assert proc.poll() is not None  # stopped on exit
