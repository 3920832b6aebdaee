"""duplexd: a self-hosted real-time streaming speech and full-duplex dialogue server."""

from __future__ import annotations

__version__ = "0.1.0"
