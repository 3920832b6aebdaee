"""An MCP server for the tool tests and `duplexd bench tools`, written with the official `mcp` SDK: a
read-only `lookup_order` (readOnlyHint) that answers after `DUPLEXD_ORDERS_DELAY_S` seconds, and a
state-changing `cancel_order`. Every call is recorded, with its wall-clock time, as a JSON line in the file
`DUPLEXD_ORDERS_LOG` names (`start`, `done` or `cancelled` for lookups; `call` for cancellations): what the
tests and the benchmark check "never before the turn was final" against.

    python -m duplexd.bench.orders_mcp                      # stdio
    python -m duplexd.bench.orders_mcp --http --port 9000   # streamable HTTP at http://127.0.0.1:9000/mcp
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations

server = MCPServer("orders", instructions="Look up and cancel orders.", log_level="WARNING")
STATUSES = ("shipped", "in transit", "delivered", "being packed")


def _record(**event: object) -> None:
    path = os.environ.get("DUPLEXD_ORDERS_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"t": time.time(), **event}) + "\n")


def status_of(order_id: str) -> str:
    """The order's status: the same for the same id, always."""
    return STATUSES[sum(map(ord, order_id)) % len(STATUSES)]


@server.tool(
    description="Look up the status of an order by its id.",
    annotations=ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True),
)
async def lookup_order(order_id: str) -> str:
    _record(tool="lookup_order", event="start", order_id=order_id)
    try:
        await asyncio.sleep(float(os.environ.get("DUPLEXD_ORDERS_DELAY_S", "0.1")))
    except asyncio.CancelledError:
        _record(tool="lookup_order", event="cancelled", order_id=order_id)
        raise
    _record(tool="lookup_order", event="done", order_id=order_id)
    return f"Order {order_id} is {status_of(order_id)}."


@server.tool(
    description="Cancel an order by its id.",
    annotations=ToolAnnotations(read_only_hint=False, destructive_hint=True),
)
async def cancel_order(order_id: str) -> str:
    _record(tool="cancel_order", event="call", order_id=order_id)
    return f"Order {order_id} is cancelled."


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m duplexd.bench.orders_mcp")
    parser.add_argument("--http", action="store_true", help="streamable HTTP (else stdio)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    args = parser.parse_args()
    if args.http:
        server.run("streamable-http", host=args.host, port=args.port)
    else:
        server.run()


if __name__ == "__main__":
    main()
