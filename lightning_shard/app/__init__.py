"""The Hydra training app: entry point, configs (``conf/``, shipped inside the package), example models and
data, callbacks, the end-of-run report, the sweep summary and the memory-estimate command; what the commands
share: one line for bad input (``cli``) and the third-party noise they filter (``quiet``)."""
