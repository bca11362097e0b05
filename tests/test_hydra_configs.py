"""The packaged Hydra configs compose as they say: an experiment's values win over the base config's, top-level
keys (``test``, ``seed``, ``precision``) included. Composed in-process, nothing is instantiated or run."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from lightning_shard.app.train import CONF_DIR

EXPERIMENTS = sorted(p.stem for p in (Path(CONF_DIR) / "experiment").glob("*.yaml"))


def composed(*overrides: str, hydra: bool = False):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=hydra)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_an_experiment_wins_over_the_base_config(experiment):
    """Composing ``experiment=X`` is the base config with X's group choices, then X's own values on top."""
    body = OmegaConf.load(Path(CONF_DIR) / "experiment" / f"{experiment}.yaml")
    choices = [f"{group.removeprefix('override /')}={option}"
               for entry in body.pop("defaults", []) for group, option in entry.items()]
    expected = OmegaConf.merge(composed(*choices), body)
    assert OmegaConf.to_yaml(composed(f"experiment={experiment}")) == OmegaConf.to_yaml(expected)


def test_the_sweep_experiment_skips_the_test_stage():
    cfg = composed("experiment=unit_size_sweep")
    assert cfg.test is False  # every sweep job ran the test stage when the base config won
    assert cfg.model.model.width == 512 and cfg.model.model.depth == 6  # gpt_25m
    assert cfg.callbacks.model_checkpoint is None


def test_the_command_line_wins_over_an_experiment():
    cfg = composed("experiment=unit_size_sweep", "test=true", "seed=3", "precision=bf16-mixed")
    assert cfg.test is True and cfg.seed == 3 and cfg.trainer.precision == "bf16-mixed"


def test_hydra_logs_through_lightning_not_its_own_job_logging():
    cfg = composed(hydra=True)
    assert cfg.hydra.runtime.choices["hydra/job_logging"] == "none"
    assert cfg.hydra.job_logging.root is None


def test_strategy_hybrid_is_full_with_shard_groups():
    from hydra.utils import instantiate

    hybrid, full = composed("strategy=hybrid", "strategy.shard_size=2").strategy, composed().strategy
    assert {**full, "sharding": "hybrid", "shard_size": 2} == dict(hybrid)
    strategy = instantiate(hybrid)
    assert (strategy.sharding, strategy.shard_size) == ("hybrid", 2)
