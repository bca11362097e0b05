"""Models for the examples, the benchmark and the Hydra configs."""
