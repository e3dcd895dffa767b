"""Loading a Hugging Face causal LM and its tokenizer for the torch-based engines."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import structlog
import torch

from plait.api import ModelError, ResolvedModel

log = structlog.get_logger("plait_train")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def select_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelError(
            "options.device = 'cuda' but torch sees no CUDA device",
            fix="set options.device = 'cpu' (or 'auto'), or install a CUDA build of torch",
        )
    return torch.device(name)


def set_threads(threads: int | None) -> None:
    if threads is not None:
        torch.set_num_threads(threads)


def model_dtype(model: ResolvedModel) -> torch.dtype:
    try:
        return DTYPES[model.dtype]
    except KeyError:
        raise ModelError(
            f"model dtype {model.dtype!r} is not supported by the torch engines",
            fix=f"set model.dtype to one of {', '.join(DTYPES)}",
        ) from None


def training_dtypes(
    model: ResolvedModel, mixed_precision: bool
) -> tuple[torch.dtype | None, torch.dtype]:
    """(compute dtype under autocast or None, dtype of the trained parameters): a bfloat16 or
    float16 model trains with float32 master weights under autocast, unless `mixed_precision` is
    off; a float32 model trains in float32."""
    dtype = model_dtype(model)
    if dtype != torch.float32 and mixed_precision:
        return dtype, torch.float32
    return None, dtype


@functools.cache
def _cached_tokenizer(path: str, mtime: float) -> Any:
    from plait_hf.chat_template import load_tokenizer

    return load_tokenizer(path)


def load_tokenizer(path: Path) -> Any:
    """The tokenizer at `path`, loaded once per process (large vocabularies take a second)."""
    config = Path(path) / "tokenizer_config.json"
    mtime = config.stat().st_mtime if config.exists() else 0.0
    return _cached_tokenizer(str(path), mtime)


def load_causal_lm(
    model: ResolvedModel,
    *,
    dtype: torch.dtype,
    device: torch.device,
    attn_implementation: str | None,
) -> Any:
    """The checkpoint at `model.path` as a transformers causal LM on `device`, in `dtype`."""
    from transformers import AutoModelForCausalLM

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory; never ask the hub
    kwargs: dict[str, Any] = {"dtype": dtype, "local_files_only": True}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    try:
        # Typed as the nn.Module it is: transformers types its own `to` (a functools.wraps of
        # Module.to) as an unbound function, which rejects `hf_model.to(device)`.
        hf_model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(str(model.path), **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(
            f"cannot load model {model.name!r} from {model.path}: {exc}",
            fix="point model.name at a Hugging Face causal-LM checkpoint directory "
            "(config.json + safetensors)",
        ) from exc
    return hf_model.to(device)


def embedding_rows(hf_model: Any) -> int:
    return int(hf_model.get_input_embeddings().weight.shape[0])


def check_tokenizer_fits(tokenizer: Any, hf_model: Any, model: ResolvedModel) -> None:
    """Fail when the tokenizer can produce ids the model has no embedding row for."""
    vocab = len(tokenizer)
    rows = embedding_rows(hf_model)
    if vocab > rows:
        raise ModelError(
            f"the tokenizer at {model.tokenizer_path} has {vocab} tokens but model {model.name!r} "
            f"({model.path}) has only {rows} embedding rows, "
            f"so token ids {rows}..{vocab - 1} would fail",
            fix="use the model's own tokenizer (unset model.tokenizer), or resize the model's "
            f"embeddings (model.resize_token_embeddings({vocab})), train them, "
            "and save the checkpoint",
        )
