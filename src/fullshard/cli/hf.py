"""``fullshard train --hf-model``: a Hugging Face ``transformers`` causal LM built from a config (random init).

``SPEC`` is a model type (``llama``, ``gpt2``, ``qwen2``...) or a ``config.json``.
A model type gets the trainer's size flags through the config's standard names
(``hidden_size``, ``num_hidden_layers``, ...); a ``config.json`` is used as is.
The vocabulary is always the 256 bytes. Nothing is fetched from a hub.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torch import nn

from fullshard.cli.launch import UserError


def _transformers() -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers
    except ImportError:
        raise UserError("--hf-model needs the transformers package: pip install -e '.[hf]'") from None
    return transformers


def build_config(spec: str, *, layers: int, dim: int, heads: int, seq_len: int) -> Any:
    transformers = _transformers()
    if spec.endswith(".json"):
        path = Path(spec)
        if not path.is_file():
            raise UserError(f"--hf-model config {spec} does not exist")
        values = json.loads(path.read_text())
        model_type = values.pop("model_type", None)
        if model_type is None:
            raise UserError(f"--hf-model config {spec} has no model_type")
        sizes: dict[str, Any] = {}
    else:
        model_type, values = spec, {}
        sizes = {"num_hidden_layers": layers, "hidden_size": dim, "num_attention_heads": heads,
                 "num_key_value_heads": heads, "intermediate_size": 4 * dim, "max_position_embeddings": seq_len}
    try:
        config = transformers.AutoConfig.for_model(model_type, **{**values, "vocab_size": 256})
    except ValueError as err:
        if model_type not in transformers.CONFIG_MAPPING:  # transformers lists every known type: too long for one line
            raise UserError(f"--hf-model: unknown model type {model_type!r} (a transformers model_type such as llama, "
                            "mistral, qwen2, gpt2; or a config .json)") from None
        raise UserError(f"--hf-model: {err}".splitlines()[0]) from None
    for name, value in sizes.items():
        if hasattr(config, name) or name in getattr(config, "attribute_map", {}):
            setattr(config, name, value)
    return config


def build_model(config: Any) -> nn.Module:
    model = _transformers().AutoModelForCausalLM.from_config(config)
    model.train()
    return model


def decoder_layer_class(model: nn.Module) -> type[nn.Module]:
    """The class of the layers in the model's longest ``ModuleList`` (its decoder stack)."""
    stacks = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not stacks:
        raise UserError(f"--hf-model: {type(model).__name__} has no list of decoder layers to shard")
    return type(max(stacks, key=len)[0])
