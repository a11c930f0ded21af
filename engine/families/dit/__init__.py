"""Single-stream DiTs (image and audio): one adapter per family."""
