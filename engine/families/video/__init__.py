"""Video DiTs: one adapter per family."""
