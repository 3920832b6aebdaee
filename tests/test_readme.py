"""The README's commands and snippets are true as pasted."""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def readme() -> str:
    return README.read_text()


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", readme(), flags=re.S)


@pytest.mark.slow
async def test_the_realtime_snippet_runs_as_pasted(make_server) -> None:
    """The OpenAI snippet, unchanged but for the port, prints a reply and exits by itself."""
    (snippet,) = [block for block in python_blocks() if "realtime.connect" in block]
    srv = await make_server()
    code = snippet.replace("127.0.0.1:8000", f"127.0.0.1:{srv.port}")
    assert code != snippet
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()
    assert len(out.decode().split()) >= 2 and out.endswith(b"\n")  # the reply's words, then a newline


def test_the_install_section_says_what_a_cpu_only_user_does() -> None:
    text = readme()
    first = re.search(r"```bash\n(.*?)```", text, flags=re.S)
    assert first is not None
    install, test = first.group(1).strip().splitlines()
    assert install.startswith("python3 -m pip install -e '.[smart-turn]' && duplexd serve")
    assert "pip install -e '.[test]'" in test and "pytest" in test
    assert "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in text  # the CPU build
    assert "CUDA build" in text
