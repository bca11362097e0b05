"""Planning: which modules form each unit, and a model on the meta device brought to life unit by unit.

    plan.py          units by class, by parameter budget, HF's declared blocks, the repeated-block rule
    materialize.py   build units from meta-device modules one at a time (rank 0's values, each rank its shard)
"""
