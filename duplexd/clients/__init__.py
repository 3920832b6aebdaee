"""Clients: the Python streaming client, and the browser client's static files (web/)."""
