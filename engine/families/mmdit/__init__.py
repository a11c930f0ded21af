"""Two-stream image DiTs (text and image tokens in joint attention): one adapter per family."""
