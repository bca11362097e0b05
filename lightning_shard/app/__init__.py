"""The Hydra training app: entry point, configs (``conf/``, shipped inside the package), example models and
data, callbacks, the sweep summary and the memory-estimate command."""
