"""Measurement and decision: sweep, lockstep timing, the planner's probe and model, plots. Imports
the training loop and the core."""
