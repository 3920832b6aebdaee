"""Engine workers: every model call runs here, off the event loop, batched or shared across sessions."""
