"""Where the dialog engine runs (`dialog.device`): the CPU, or an NVIDIA GPU through a CUDA build of torch.

The engine's bookkeeping (which token is in which KV row, the masks, the rotations) is built on the CPU,
a few small tensors per step; the weights, the KV pool and every step's arithmetic live on the device, and
the step's logits come back to the CPU once (the token choice reads them there).
"""

from __future__ import annotations

import torch

from duplexd.errors import EngineError


def torch_device(name: str) -> torch.device:
    """`dialog.device` (`cpu`, `cuda`, `cuda:N`) as a torch device. Raises `EngineError` with one readable line
    where torch cannot reach it (a CPU build of torch, no driver, no such GPU)."""
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise EngineError(f"dialog.device = {name!r} is not a device: {exc}") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise EngineError(f"dialog.device = {name!r}: only cpu and cuda are supported")
    if not torch.cuda.is_available():
        raise EngineError(
            f"dialog.device = {name!r}, but torch {torch.__version__} sees no CUDA GPU "
            '(a CPU build of torch, or no NVIDIA driver): set dialog.device = "cpu"'
        )
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise EngineError(f"dialog.device = {name!r}, but torch sees {torch.cuda.device_count()} GPU(s)")
    return torch.device("cuda", index)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (timing a GPU without it times the launches, not the work)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def describe(device: torch.device) -> str:
    """The device in words, for `/healthz`, the tuning cache key and benchmark JSON."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{props.name} (sm_{props.major}{props.minor}, {props.total_memory / (1 << 30):.0f} GiB)"
    return "cpu"
