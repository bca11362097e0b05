"""Scenarios for test_docs.py, run inside a gloo world: the setup report the app's configs give, for the figures the
user's pages quote."""

from __future__ import annotations

import logging
import warnings

from tests.world import as_lightning_rank


def setup_reports(rank: int, world: int, runs: list[list[str]], root: str) -> list[str]:
    """For each list of Hydra overrides: the lines ``lightning_shard:`` logs at setup when the app fits that config on
    this world (no step taken: ``trainer.max_steps=0``; no callbacks or loggers, which change nothing there)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from lightning_shard.app.train import CONF_DIR, build

    as_lightning_rank(rank, world)
    warnings.simplefilter("ignore")
    records: list[logging.LogRecord] = []
    handler = logging.Handler(level=logging.INFO)
    handler.emit = records.append
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).addHandler(handler)
    reports = []
    for overrides in runs:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            cfg = compose(config_name="config", overrides=[
                *overrides, f"trainer.devices={world}", "trainer.max_steps=0", "+trainer.num_sanity_val_steps=0",
                "logger=none", "test=false", f"trainer.default_root_dir={root}"])
        with open_dict(cfg):
            cfg.callbacks = None
        data, module, trainer = build(cfg)
        del records[:]
        trainer.fit(module, data)
        reports.append("\n".join(r.getMessage() for r in records if r.getMessage().startswith("lightning_shard:")))
    return reports
