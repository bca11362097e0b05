"""Offline datasets for the examples and the benchmark."""
