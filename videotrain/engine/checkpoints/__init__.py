"""Checkpoint files and the resume guard: the file format and its safe loader, the run's
checkpoint owner (last, best, pruning), the class-order check, and what a resume may change."""
