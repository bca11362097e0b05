"""Ported scenarios: what a LightningModule does to its checkpoints (a ``state_dict`` override, ``on_save_checkpoint``
/ ``on_load_checkpoint`` edits, ``strict_loading``), from Lightning's docs and test_checkpoint_connector.py."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch import nn

from tests.lightning_port_models import (
    FEATURES, BoringNet, assert_same, broadcast_path, loader, scenario, shard, state_of, trainer,
)


class BackboneNet(BoringNet):
    """Lightning's documented way of not saving a frozen part ("Partial loading": ``state_dict`` overridden to leave
    it out, ``strict_loading = False``), or (``edit="hooks"``) the same done in ``on_save_checkpoint``, with keys
    renamed back in ``on_load_checkpoint`` (``old_layer.`` in the file, ``layer.`` in the module)."""

    def __init__(self, edit: str = "state_dict") -> None:
        super().__init__()
        self.backbone = nn.Linear(FEATURES, FEATURES)
        self.backbone.requires_grad_(False)
        self.edit = edit
        self.strict_loading = False

    def forward(self, x):
        return self.layer(self.backbone(x))

    def state_dict(self, *args, **kwargs):
        state = super().state_dict(*args, **kwargs)
        if self.edit == "state_dict":
            return type(state)((k, v) for k, v in state.items() if not k.startswith("backbone."))
        if self.edit == "renamed":
            return type(state)((k.replace("layer.", "old_layer."), v) for k, v in state.items())
        return state

    def on_save_checkpoint(self, checkpoint):
        if self.edit == "hooks":
            checkpoint["state_dict"] = {k.replace("layer.", "old_layer."): v for k, v in checkpoint["state_dict"].items()
                                        if not k.startswith("backbone.")}

    def on_load_checkpoint(self, checkpoint):
        if self.edit == "hooks":
            checkpoint["state_dict"] = {k.replace("old_layer.", "layer."): v for k, v in checkpoint["state_dict"].items()}
            checkpoint["state_dict"]["layer.2.bias"] = torch.zeros(2)  # a head's bias reset: a value given whole
            try:  # a sharded checkpoint's values are read after this hook: reading one says so
                self.read_error = str(checkpoint["state_dict"]["layer.0.weight"].float())
            except AttributeError as err:
                self.read_error = str(err)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.layer.parameters(), lr=self.hparams.lr)


def _saved_keys(path: Path) -> list[str]:
    if path.is_dir():
        from torch.distributed.checkpoint import FileSystemReader

        keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        return sorted(k[len("state_dict."):] for k in keys if k.startswith("state_dict."))
    return sorted(torch.load(path, weights_only=True)["state_dict"])


def _customised_checkpoints(rank: int, world: int, root: Path, edit: str) -> dict:
    saved, runs = {}, {}
    for name in ("ddp", "sharded", "full"):
        torch.manual_seed(0)
        model = BackboneNet(edit)
        t = trainer("ddp" if name == "ddp" else shard(state_dict_type=name), root / name)
        t.fit(model, loader(1))
        path = broadcast_path(root / name / "epoch1.ckpt")
        t.save_checkpoint(path)
        saved[name] = _saved_keys(path)
        torch.manual_seed(0)  # the same backbone, the head a different one until the checkpoint loads
        resumed = BackboneNet(edit)
        torch.manual_seed(5)
        resumed.layer = BoringNet.build()
        t = trainer("ddp" if name == "ddp" else shard(state_dict_type=name), root / name, max_epochs=2)
        t.fit(resumed, loader(1), ckpt_path=path)
        runs[name] = (model.losses + resumed.losses, state_of(t))
        if edit == "hooks":
            assert (name == "sharded") == resumed.read_error.startswith("lightning_shard: 'old_layer.0.weight' of the"
                                                                        " sharded checkpoint"), resumed.read_error
    for name in ("sharded", "full"):
        assert saved[name] == saved["ddp"], (name, saved[name], saved["ddp"])
        torch.testing.assert_close(torch.tensor(runs[name][0]), torch.tensor(runs["ddp"][0]), rtol=1e-5, atol=1e-6)
        assert_same(runs[name][1], runs["ddp"][1], f"resumed from {name}")
    return {"saved": saved["ddp"]}


@scenario
def state_dict_override_not_saving_frozen(rank: int, world: int, root: Path) -> dict:
    return _customised_checkpoints(rank, world, root, "state_dict")


@scenario
def state_dict_override_renaming(rank: int, world: int, root: Path) -> dict:
    """A ``state_dict`` that renames keys: a full checkpoint holds what it returns (as ddp's); a sharded one cannot
    give a parameter's shards another name, and is refused when the fit is set up, saying where to rename."""
    saved, errors = {}, {}
    for name in ("ddp", "full", "sharded"):
        t = trainer("ddp" if name == "ddp" else shard(state_dict_type=name), root / name)
        try:
            t.fit(BackboneNet("renamed"), loader(1))
        except Exception as err:  # noqa: BLE001
            errors[name] = f"{type(err).__name__}: {err}"
            continue
        path = broadcast_path(root / name / "epoch1.ckpt")
        t.save_checkpoint(path)
        saved[name] = _saved_keys(path)
    assert saved["full"] == saved["ddp"] and "sharded" in errors and len(errors) == 1, (saved, errors)
    return {"saved": saved["full"], "sharded": errors["sharded"]}


@scenario
def checkpoint_hooks_edit_state_dict(rank: int, world: int, root: Path) -> dict:
    return _customised_checkpoints(rank, world, root, "hooks")


class GrownNet(BoringNet):
    """A module that gained a layer (``extra``) or lost one since its checkpoint was saved; ``planted``: its
    ``on_load_checkpoint`` puts a tensor under a name it does not have."""

    def __init__(self, extra: bool, strict: Optional[bool], planted: bool = False) -> None:
        super().__init__()
        self.extra = nn.Linear(2, 2) if extra else None
        self.planted = planted
        if strict is not None:
            self.strict_loading = strict

    def on_load_checkpoint(self, checkpoint):
        if self.planted:
            checkpoint["state_dict"]["nowhere.weight"] = torch.zeros(2)

    def forward(self, x):
        out = self.layer(x)
        return out if self.extra is None else self.extra(out)


@scenario
def strict_loading(rank: int, world: int, root: Path) -> dict:
    """test_checkpoint_connector.py ``test_strict_loading`` (the module's ``strict_loading`` reaches the strategy's
    ``load_model_state_dict``): a checkpoint missing a key, one with a key the module lacks, and a tensor
    ``on_load_checkpoint`` put under a name the module lacks, strict and not; what each strategy raised, and, where it
    loaded, the values (ddp's)."""
    out: dict[str, dict] = {}
    for name in ("ddp", "sharded", "full"):
        for saved_extra in (False, True):
            torch.manual_seed(0)
            t = trainer("ddp" if name == "ddp" else shard(state_dict_type=name), root / name, max_steps=2)
            t.fit(GrownNet(saved_extra, None), loader(1))
            path = broadcast_path(root / name / f"{saved_extra}.ckpt")
            t.save_checkpoint(path, weights_only=True)
            for strict, planted in ((None, False), (False, False), (None, True), (False, True)):
                if planted and not saved_extra:
                    continue
                torch.manual_seed(1)
                model = GrownNet(saved_extra, strict, planted) if planted else GrownNet(not saved_extra, strict)
                t = trainer("ddp" if name == "ddp" else shard(), root / name, barebones=True)
                try:
                    t.validate(model, loader(2), ckpt_path=path, verbose=False)
                    result = state_of(t)
                except Exception as err:  # noqa: BLE001
                    result = type(err).__name__ + ": " + str(err).splitlines()[0]
                case = f"saved_extra={saved_extra}, strict={strict}" + (", planted" if planted else "")
                out.setdefault(name, {})[case] = result
    for kind in ("sharded", "full"):
        for case, expected in out["ddp"].items():
            ours = out[kind][case]
            if isinstance(expected, str):
                assert isinstance(ours, str), (kind, case, "loaded where ddp raised", expected)
            else:
                assert not isinstance(ours, str), (kind, case, ours)
                assert_same(ours, expected, f"{kind}: {case}", 0, 0)
    return {kind: {case: value if isinstance(value, str) else "loaded" for case, value in out[kind].items()}
            for kind in ("sharded", "full")}
