"""How the models' OpenMP threads wait (`cli.openmp_setup`, measured by `duplexd bench threads`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from duplexd.bench import threads

_PROBE = (
    "import json, os, sys; from duplexd.cli import openmp_setup; openmp_setup(); "
    "first = 'ctranslate2' in sys.modules; import torch; "
    "print(json.dumps({'ct2_before_torch': first, 'spin': os.environ.get('GOMP_SPINCOUNT'), "
    "'policy': os.environ.get('OMP_WAIT_POLICY')}))"
)


def _probe(**env: str) -> dict[str, object]:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    done = subprocess.run([sys.executable, "-c", _PROBE], env=base | env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def test_the_recognizer_keeps_its_own_runtime_and_idle_threads_spin_briefly() -> None:
    assert _probe() == {"ct2_before_torch": True, "spin": "10000", "policy": None}


def test_a_users_own_wait_policy_is_kept() -> None:
    assert _probe(OMP_WAIT_POLICY="PASSIVE") == {"ct2_before_torch": True, "spin": None, "policy": "PASSIVE"}
    assert _probe(GOMP_SPINCOUNT="500")["spin"] == "500"


def test_the_threads_table_shows_each_setup_and_its_slowdowns() -> None:
    setup = {
        "llm_tok_s_alone": 90.0,
        "llm_tok_s_beside_asr": 30.0,
        "asr_pass_s_alone": 0.4,
        "asr_pass_s_beside_llm": 0.5,
        "llm_slowdown_beside_asr": 3.0,
        "asr_slowdown_beside_llm": 1.25,
    }
    shown = threads.table({"sessions": 4, "setups": {"separate_spin": setup}})
    assert "| separate_spin | 90.0 | 30.0 (/3.00) | 0.400 s | 0.500 s (x1.25) |" in shown
    assert set(threads.SETUPS) >= {"shared_passive", "separate_spin"}


def test_the_vad_model_is_found_without_importing_silero_vad() -> None:
    """Importing the `silero_vad` package sets torch's threads to 1 for the whole process."""
    probe = (
        "import json, sys, torch; before = torch.get_num_threads(); from duplexd.asr.vad import SileroVad; "
        "SileroVad(); print(json.dumps({'imported': 'silero_vad' in sys.modules, "
        "'kept': torch.get_num_threads() == before}))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert json.loads(done.stdout) == {"imported": False, "kept": True}
