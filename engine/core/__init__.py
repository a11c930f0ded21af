"""The checkpointing core: schedule keys and the per-block plan, the one segment runner, offload hooks and
the host pool, the generic fallback, memory and time measurement of a step. Imports nothing above it."""
