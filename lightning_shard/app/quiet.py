"""Third-party messages that are not the user's business, silenced by our commands and examples (and their spawned
ranks, which start with fresh filters) but never on import of the library: a user's own script sees everything.

Lightning's note before ``trainer.test`` on several ranks, that its DistributedSampler "replicates some samples" to
give every rank as many, is shown where it is true of the run (a sample was tested twice: it says how the test metrics
were computed), and dropped where no sample was (`tested_once`).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

from torch.utils.data.distributed import DistributedSampler

SAMPLER_NOTE = "Using `DistributedSampler` with the dataloaders. During `trainer.test()`"


def quiet() -> None:
    # Lightning 2.6 builds torch's LeafSpec, deprecated in torch 2.13: a FutureWarning per fit, validate and
    # test about Lightning's code, which nothing in a user's code or config can change
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning)
    # peft's get_peft_model and prepare_model_for_kbit_training call transformers 5's deprecated
    # `is_gradient_checkpointing` and `gradient_checkpointing_enable` (a FutureWarning per process, pointing into
    # transformers): peft's business, not the user's
    warnings.filterwarnings("ignore", message=r"`(is_)?gradient_checkpointing(_enable)?` is deprecated",
                            category=FutureWarning, module=r"transformers\.modeling_utils")
    # Lightning advertises its cloud services on every run ("💡 Tip: ... litlogger", "... litmodels"); the
    # rank-zero logger is named after whichever of fabric and pytorch was imported last
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(_not_a_tip)
    # bitsandbytes, imported by peft and transformers in every Hugging Face run, says on CPUs with AVX512-BF16 that
    # it failed to load a faster kernel for 4-bit inference from the Hub ("pip install kernels"): training never
    # uses it, and the package it asks for downloads code at import (docs/hf.md#qlora-a-4-bit-base)
    logging.getLogger(BNB_CPU_LOGGER).addFilter(_not_the_kernels_note)


BNB_CPU_LOGGER = "bitsandbytes.backends.cpu.ops"


def _not_a_tip(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("💡 Tip")


def _not_the_kernels_note(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward from kernels-community")


@contextmanager
def tested_once(trainer: Any) -> Iterator[None]:
    """Around ``trainer.test``: its warnings are shown as they would have been, after it, except Lightning's sampler
    note where no sample was tested twice (the batches tested per rank, times the ranks, stay within the test set:
    what the sampler added to even out the ranks was never reached, as with ``limit_test_batches`` or a test set
    that divides evenly)."""
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:  # the filters in force still decide what is recorded
            yield
    finally:  # also when the test raised
        for w in caught:
            if not (str(w.message).startswith(SAMPLER_NOTE) and repeated_test_samples(trainer) == 0):
                warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)


def repeated_test_samples(trainer: Any) -> Optional[int]:
    """Samples the last ``trainer.test`` evaluated twice because Lightning's DistributedSampler pads the test set to a
    multiple of the ranks; None where that cannot be told (no sampler of that kind, no batch size)."""
    loaders = trainer.test_dataloaders
    loaders = loaders if isinstance(loaders, (list, tuple)) else [loaders]
    repeated = 0
    for loader, batches in zip(loaders, trainer.num_test_batches):
        sampler = getattr(loader, "sampler", None)
        if not isinstance(sampler, DistributedSampler) or not loader.batch_size or math.isinf(batches):
            return None
        per_rank = min(int(batches) * loader.batch_size, sampler.num_samples)  # the sampler's first, on each rank
        # rank r takes positions r, r + ranks, ... of the padded order: the first per_rank * ranks positions are
        # tested, and those past the dataset's length are the repeats
        repeated += max(0, per_rank * sampler.num_replicas - len(sampler.dataset))
    return repeated
