"""The I/O shell: WebSocket server, wire protocol, HTTP routes."""
