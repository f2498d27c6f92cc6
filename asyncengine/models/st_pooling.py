"""What a sentence-transformers checkpoint says about pooling: ``modules.json`` lists the pipeline
(Transformer -> Pooling -> optional Normalize), ``1_Pooling/config.json`` (or wherever the Pooling
entry points) names the reduction. Honouring it is what makes our embedding equal the one the
model was trained to produce; a checkpoint without ``modules.json`` gets the caller's default.

Modules we do not run (Dense projections, weighted-mean pooling, ...) are refused by name rather
than silently skipped: the result would be a different, wrong embedding."""
from __future__ import annotations

import json
from pathlib import Path

from asyncengine.errors import ModelLoadError
from asyncengine.pooling_params import PoolingSpec  # not layers.pooler: the front end reads this, without torch

_TRANSFORMER = "sentence_transformers.models.Transformer"
_POOLING = "sentence_transformers.models.Pooling"
_NORMALIZE = "sentence_transformers.models.Normalize"
# pooling_mode_* flag -> our pooling name
_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}


def _pooling_from_config(cfg: dict, where: Path) -> str:
    on = [k for k, v in cfg.items() if k.startswith("pooling_mode") and v]
    unknown = [k for k in on if k not in _MODES]
    if unknown or len(on) != 1:
        raise ModelLoadError(f"{where}: pooling modes {on or '(none)'} are not supported; "
                             f"exactly one of {', '.join(_MODES)} must be set")
    return _MODES[on[0]]


def read_st_pooling(model_dir: str | Path) -> PoolingSpec | None:
    """The checkpoint's own PoolingSpec, or None when it is not a sentence-transformers checkpoint."""
    root = Path(model_dir)
    modules_file = root / "modules.json"
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{modules_file}: not valid JSON ({e})") from None
    pooling, normalize = None, False
    for m in sorted(modules, key=lambda m: int(m.get("idx", 0))):
        kind = m.get("type", "")
        if kind == _TRANSFORMER:
            continue
        if kind == _POOLING:
            cfg_file = root / m.get("path", "1_Pooling") / "config.json"
            if not cfg_file.is_file():
                raise ModelLoadError(f"{modules_file} names a Pooling module but {cfg_file} is missing")
            pooling = _pooling_from_config(json.loads(cfg_file.read_text()), cfg_file)
        elif kind == _NORMALIZE:
            normalize = True
        else:
            raise ModelLoadError(f"{modules_file}: module {kind!r} is not supported "
                                 f"(we run {_TRANSFORMER}, {_POOLING} and {_NORMALIZE})")
    if pooling is None:
        raise ModelLoadError(f"{modules_file} has no {_POOLING} module")
    return PoolingSpec(pooling=pooling, normalize=normalize)
