"""The per-connection session core: audio frames in, events out. No I/O, no threads, no clocks."""
