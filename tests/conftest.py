"""Fixtures shared by the whole suite."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The real default model as a safetensors checkpoint.

    Converted on first use under the normal Switchboard home (~/.cache/switchboard or
    $SWITCHBOARD_HOME), so later sessions and CI runs on the same machine reuse it.
    """
    from worker.default_model import prepare_default_model

    return prepare_default_model()
