"""Accuracy, peak memory and metric logging."""
