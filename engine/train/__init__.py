"""The training loop and its inputs: config, data, text, loading, precision, LoRA I/O, objectives,
state, report. Imports the core and the families, never measurement."""
