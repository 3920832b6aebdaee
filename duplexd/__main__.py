from __future__ import annotations

from duplexd.cli import main

raise SystemExit(main())
