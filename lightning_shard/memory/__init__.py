"""Memory: the per-rank peak predicted before a run (``estimate.py``) and measured tensor by tensor (``tracker.py``)."""
