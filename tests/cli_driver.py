"""Run several commands in one interpreter, each as ``python -m MODULE ARGS`` (or ``python SCRIPT.py ARGS``) would,
and print each one's exit status and output as JSON: bad-input cases then cost one interpreter start (torch,
Lightning, Hydra imports), not one each. (Whether a command runs cleanly from a fresh interpreter is
test_commands.py's --help test.)

    python tests/cli_driver.py '[["lightning_shard.train", ["precision=fp8"]], ...]'
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import sys
import warnings


def run_case(module: str, args: list[str]) -> dict:
    from hydra.core.global_hydra import GlobalHydra

    out, err = io.StringIO(), io.StringIO()
    sys.argv = [module, *args]
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*found in sys.modules", category=RuntimeWarning)  # 2nd run
        try:
            if module.endswith(".py"):  # a script: ``python PATH ARGS``, its folder first on the path as there
                sys.path.insert(0, os.path.dirname(os.path.abspath(module)))
                try:
                    runpy.run_path(module, run_name="__main__")
                finally:
                    sys.path.pop(0)
            else:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    GlobalHydra.instance().clear()  # a Hydra app that stopped early leaves it set
    return {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


if __name__ == "__main__":
    print(json.dumps([run_case(module, args) for module, args in json.loads(sys.argv[1])]))
