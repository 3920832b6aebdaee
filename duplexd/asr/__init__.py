"""Voice activity detection, streaming ASR (sliding window + commit policy) and its engines."""
