"""Our commands filter Lightning's noise (its deprecation warnings about its own code, its advertisements) and
nothing else; importing the library filters nothing. (A whole run's stderr: tests/test_train_hydra.py.)"""

from __future__ import annotations

import logging
import warnings

import pytest

import lightning_shard  # noqa: F401  # importing it must not filter
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning_utilities.core import rank_zero

from lightning_shard.app import quiet as quiet_module
from lightning_shard.app.quiet import quiet


@pytest.fixture(autouse=True)
def _unfiltered_loggers():
    yield
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).removeFilter(quiet_module._not_a_tip)
    logging.getLogger(quiet_module.BNB_CPU_LOGGER).removeFilter(quiet_module._not_the_kernels_note)


def test_only_lightnings_noise_is_filtered():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet()
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec)`",
                      FutureWarning)
        warnings.warn("a FutureWarning of the user's", FutureWarning)
    assert [str(w.message) for w in seen] == ["a FutureWarning of the user's"]


def test_transformers_deprecation_that_peft_trips_is_filtered_where_transformers_raises_it_only():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet()
        for name in ("is_gradient_checkpointing", "gradient_checkpointing_enable"):
            deprecated = f"`{name}` is deprecated and will be removed in v6."
            warnings.warn_explicit(deprecated, FutureWarning, "modeling_utils.py", 1,
                                   module="transformers.modeling_utils")
            warnings.warn_explicit(deprecated, FutureWarning, "mine.py", 1, module="mine")  # not transformers' own
    assert [w.filename for w in seen] == ["mine.py", "mine.py"]


def test_the_bitsandbytes_kernels_note_is_filtered_not_its_other_warnings():
    log = logging.getLogger(quiet_module.BNB_CPU_LOGGER)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    log.addHandler(handler)
    try:
        quiet()
        log.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you already"
                    " `pip install kernels`", "No module named 'kernels'")
        log.warning("another warning of bitsandbytes")
    finally:
        log.removeHandler(handler)
    assert [r.getMessage() for r in records] == ["another warning of bitsandbytes"]


def test_lightnings_tips_are_filtered_not_its_information():
    assert quiet_module._not_a_tip not in rank_zero.log.filters  # not by importing lightning_shard
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    rank_zero.log.addHandler(handler)
    try:
        quiet()
        rank_zero_info("💡 Tip: For seamless cloud logging and experiment tracking, try installing litlogger")
        rank_zero_info("GPU available: False, used: False")
    finally:
        rank_zero.log.removeHandler(handler)
    assert [r.getMessage() for r in records] == ["GPU available: False, used: False"]


def _tested(dataset_len: int, batch_size: int, batches: int, drop_last: bool = False):
    """A Trainer after ``test`` as far as the sampler note needs: rank 0 of 2, Lightning's DistributedSampler."""
    from types import SimpleNamespace

    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    dataset = TensorDataset(torch.arange(dataset_len))
    sampler = DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=False)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last)
    return SimpleNamespace(test_dataloaders=loader, num_test_batches=[batches])


@pytest.mark.parametrize("dataset_len, batch_size, batches, drop_last, repeated", [
    (9, 2, 3, False, 1),   # 5 samples a rank, the sampler's 10th is sample 0 again, and it is tested
    (9, 2, 2, False, 0),   # limit_test_batches=2: 8 of 9 tested, the repeat never reached
    (9, 2, 2, True, 0),    # drop_last: the last (padded) batch is not tested
    (10, 2, 3, False, 0),  # divides evenly: nothing padded
    (9, 4, 2, False, 1),   # 5 a rank in batches of 4: all 5 tested
])
def test_repeated_test_samples_counts_what_the_sampler_padded_and_was_tested(dataset_len, batch_size, batches,
                                                                              drop_last, repeated):
    assert quiet_module.repeated_test_samples(_tested(dataset_len, batch_size, batches, drop_last)) == repeated


@pytest.mark.parametrize("repeated", [True, False])
def test_the_sampler_note_is_shown_where_a_sample_was_tested_twice_and_other_warnings_always(repeated):
    trainer = _tested(9, 2, 3 if repeated else 2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet_module.tested_once(trainer):
            warnings.warn(quiet_module.SAMPLER_NOTE + ", it is recommended to use `Trainer(devices=1, num_nodes=1)`")
            warnings.warn("a warning of the user's")
    shown = [str(w.message) for w in seen]
    assert ("a warning of the user's" in shown) and len(shown) == (2 if repeated else 1), shown
