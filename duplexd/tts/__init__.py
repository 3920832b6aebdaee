"""Text to speech: engines behind one protocol, and the chunker that feeds them reply text as it streams."""
