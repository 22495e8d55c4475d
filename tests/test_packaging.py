"""The repo's kernels/ installs as flashtrain.kernels, never as a top-level `kernels` module."""

import importlib.metadata
import importlib.util
from pathlib import Path

import flashtrain
import flashtrain.kernels

REPO = Path(__file__).resolve().parents[1]


def test_kernels_ship_inside_flashtrain():
    assert Path(flashtrain.kernels.__file__).resolve().parent.name == "kernels"
    assert flashtrain.kernels.__name__ == "flashtrain.kernels"


def test_no_top_level_kernels_or_conf_from_this_repo():
    for name in ("kernels", "conf"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:  # a PyPI package of that name may exist; it must not be ours
            assert REPO not in Path(spec.origin).resolve().parents, f"top-level {name!r} resolves into the repo"


def test_distribution_top_level_is_flashtrain_only():
    dist = importlib.metadata.distribution("flashtrain")
    top = dist.read_text("top_level.txt")
    if top is not None:
        assert top.split() == ["flashtrain"]
