"""Export a trained GPT as ``model.safetensors`` and ``config.json``, and load it back into the plain ``GPT``.

``export(source, out_dir)`` takes a ``GPTModule`` or the path of a Lightning checkpoint (``.ckpt``: hparams under
"hyper_parameters", weights under "state_dict" with the prefix ``model.``) and writes:

  * ``model.safetensors``: the GPT's state_dict, the tied embedding once, as ``wte.weight`` (safetensors refuses
    tensors that share memory; ``load`` ties ``lm_head.weight`` to it again);
  * ``config.json``: {"model": the GPTConfig fields, "attn": {"name", "options"}: the backend trained with, and
    "data": {"tokenizer", "vocab_size", "eod_token"} where the checkpoint holds them (the trainer's module hparams
    do not: then "data" is absent and a reader assumes UTF-8 bytes with end-of-document id ``BYTE_EOD``)}.

``load(path)`` builds the GPT from an export directory with no Lightning import, or from a ``.ckpt`` file
(``torch.load``; unpickling the checkpoint imports Lightning itself); ``load_with_config`` also returns the
config.json dict, and ``read_config`` that dict alone.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from . import backends
from .model import GPT, GPTConfig

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
TIED = "lm_head.weight"  # stored as wte.weight alone
BYTE_EOD = 256  # flashtrain.trainer.data.BYTE_EOD, repeated so that loading an export imports no Lightning
DATA_KEYS = ("tokenizer", "vocab_size", "eod_token")


def export(source, out_dir) -> Path:
    """Write ``out_dir/model.safetensors`` and ``out_dir/config.json`` for ``source``, a ``GPTModule`` or the
    path of a Lightning ``.ckpt``; returns ``out_dir``."""
    from safetensors.torch import save_file

    model, config = _from_checkpoint(source) if isinstance(source, (str, Path)) else _from_module(source)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().cpu().contiguous() for name, t in model.state_dict().items() if name != TIED}
    save_file(state, out / WEIGHTS, metadata={"format": "pt"})
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out


def read_config(path) -> dict:
    """The ``config.json`` of an export directory, or what ``export`` would write for a ``.ckpt`` file."""
    path = Path(path)
    if path.is_dir():
        config_file = path / CONFIG
        if not config_file.is_file():
            raise FileNotFoundError(f"path={str(path)!r} has no {CONFIG}; expected a directory written by export()")
        return json.loads(config_file.read_text())
    return _checkpoint_config(_read_checkpoint(path))


def load(path, attn: str | None = "flash", device="cpu", dtype: torch.dtype | None = None) -> GPT:
    """The GPT of an export directory (or of a ``.ckpt`` file), in eval mode on ``device``, cast to ``dtype``
    when given. ``attn``: the attention backend of ``GPT.forward`` (a name in ``backends.BACKENDS``); None
    takes the one recorded with the weights, with its options."""
    return load_with_config(path, attn, device, dtype)[0]


def load_with_config(path, attn: str | None = "flash", device="cpu",
                     dtype: torch.dtype | None = None) -> tuple[GPT, dict]:
    """``load``'s GPT and the config.json dict it was built from (a checkpoint is read once)."""
    path = Path(path)
    if path.is_dir():
        config = read_config(path)
        model = GPT(_gpt_config(config["model"]), _backend(config, attn))
        _load_weights(model, path / WEIGHTS)
    else:
        model, config = _from_checkpoint(path)
        _set_backend(model, config, attn)
    return model.to(device=device, dtype=dtype).eval(), config


def _from_module(module) -> tuple[GPT, dict]:
    """(GPT, config.json dict) of a GPTModule (duck-typed: ``hparams`` and ``model``, so no Lightning import)."""
    if not (hasattr(module, "hparams") and isinstance(getattr(module, "model", None), GPT)):
        raise TypeError(f"export: source is a {type(module).__name__}; expected a GPTModule or the path of a "
                        "Lightning .ckpt file")
    return module.model, _config_dict(module.model.config, dict(module.hparams))


def _from_checkpoint(path) -> tuple[GPT, dict]:
    """(GPT, config.json dict) of a Lightning checkpoint, weights loaded strictly."""
    checkpoint = _read_checkpoint(path)
    config = _checkpoint_config(checkpoint)
    state = {name[len("model."):]: t for name, t in checkpoint["state_dict"].items() if name.startswith("model.")}
    model = GPT(GPTConfig(**config["model"]), backends.eager)  # load sets the backend asked for
    model.load_state_dict(state, strict=True)
    return model, config


def _read_checkpoint(path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"path={str(path)!r}: no such file or directory; expected a Lightning .ckpt or "
                                "an export directory")
    # weights_only=False: Lightning checkpoints hold plain Python objects (hparams, loop states)
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint or "hyper_parameters" not in checkpoint:
        raise ValueError(f"path={str(path)!r} is not a Lightning checkpoint of a GPTModule; expected the keys "
                         "'state_dict' and 'hyper_parameters'")
    return checkpoint


def _checkpoint_config(checkpoint: dict) -> dict:
    hparams = dict(checkpoint["hyper_parameters"])
    if "model" not in hparams or "attn" not in hparams:
        raise ValueError(f"the checkpoint's hyper_parameters have the keys {sorted(hparams)}; expected a "
                         "GPTModule's 'model' and 'attn'")
    data = {**(checkpoint.get("datamodule_hyper_parameters") or {}), **(hparams.get("data") or {})}
    return _config_dict(_gpt_config(hparams["model"]), hparams, data)


def _gpt_config(fields: dict) -> GPTConfig:
    known = {f.name for f in dataclasses.fields(GPTConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"model config has unknown fields {unknown}; expected GPTConfig fields {sorted(known)}")
    return GPTConfig(**fields)


def _config_dict(config: GPTConfig, hparams: dict, data: dict | None = None) -> dict:
    """config.json: the GPTConfig fields, the attention backend and the tokenizer spec where known."""
    out = {"model": dataclasses.asdict(config),
           "attn": {"name": hparams.get("attn"), "options": dict(hparams.get("attn_options") or {})}}
    data = {k: data[k] for k in DATA_KEYS if k in (data or {})}
    if data:
        out["data"] = data
    return out


def _backend(config: dict, attn: str | None):
    """The attention function for ``attn``, or the recorded backend (with its options) when None."""
    if attn is None:
        recorded = config.get("attn") or {}
        if not recorded.get("name"):
            raise ValueError("attn=None takes the recorded backend, but the config names none; pass attn='flash'")
        return backends.get(recorded["name"], **recorded.get("options", {}))
    return backends.get(attn)


def _set_backend(model: GPT, config: dict, attn: str | None) -> None:
    """Put ``model``'s blocks behind the backend for ``attn`` (a plain attribute of each attention layer)."""
    fn = _backend(config, attn)
    for block in model.blocks:
        block.attn.attn = fn


def _load_weights(model: GPT, weights: Path) -> None:
    """Load ``model.safetensors`` into ``model``: ``lm_head.weight`` is absent from the file and stays tied to
    ``wte.weight``, which load_state_dict fills in place."""
    from safetensors.torch import load_file

    if not weights.is_file():
        raise FileNotFoundError(f"{str(weights)!r}: no such file; expected the weights written by export()")
    result = model.load_state_dict(load_file(weights), strict=False)
    missing = [name for name in result.missing_keys if name != TIED]
    if missing or result.unexpected_keys:
        raise ValueError(f"{str(weights)!r} does not fit the config: missing {missing}, unexpected "
                         f"{result.unexpected_keys}")
