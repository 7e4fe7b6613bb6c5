"""The package's import structure: import-linter's contracts (pyproject.toml
``[tool.importlinter]``) hold: the layers look only down, and (``acyclic_siblings``) no
import circle exists between sibling modules or packages at any depth, which rules out
every circle between modules; grimp counts the imports inside functions and under
``TYPE_CHECKING`` too."""

from __future__ import annotations

import logging
from pathlib import Path

from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[1]


def test_import_linter_contracts_hold(capsys):
    # lint_imports configures logging with dictConfig, which disables every logger that
    # exists (the package's too): the tests after this one would see no log record
    loggers = [logger for logger in logging.root.manager.loggerDict.values()
               if isinstance(logger, logging.Logger)]
    disabled = [logger.disabled for logger in loggers]
    try:
        code = lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True,
                            no_logo=True)
    finally:
        for logger, was in zip(loggers, disabled):
            logger.disabled = was
    assert code == 0, capsys.readouterr().out
