"""Model skeletons for :func:`~torch_bq.nn.load_quantized_`: weights on ``meta``, computed buffers real.

``with torch.device("meta"): Model(config)`` puts *everything* on meta, including
buffers that no checkpoint holds because the model computes them in its
constructor (the rotary embedding's ``inv_freq``, causal masks). Those stay on
meta after loading and the first forward fails, or reads garbage.
:func:`empty_model` builds the model with every parameter and every
*persistent* buffer on meta (the checkpoint fills them) and every
non-persistent buffer computed for real on CPU, so
``load_quantized_(empty_model(config), path)`` gives a model that runs.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Union

import torch
from torch import nn

__all__ = ["empty_model", "meta_weights"]


@contextlib.contextmanager
def meta_weights():
    """Inside the block, parameters and persistent buffers are moved to ``meta`` as modules register them.

    Modules' own initialisation (``reset_parameters``) then runs on meta and costs
    nothing; non-persistent buffers keep the device they were computed on.
    Affects every module constructed in the block (not thread-safe, like any
    patch of ``nn.Module``).
    """
    register_parameter = nn.Module.register_parameter
    register_buffer = nn.Module.register_buffer

    def to_meta_parameter(self, name, param):
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        return register_parameter(self, name, param)

    def to_meta_buffer(self, name, tensor, persistent=True):
        if tensor is not None and persistent and not tensor.is_meta:
            tensor = tensor.to("meta")
        return register_buffer(self, name, tensor, persistent)

    nn.Module.register_parameter = to_meta_parameter
    nn.Module.register_buffer = to_meta_buffer
    try:
        yield
    finally:
        nn.Module.register_parameter = register_parameter
        nn.Module.register_buffer = register_buffer


def _is_hf_config(obj: Any) -> bool:
    # Duck-typed so that torch_bq.nn never imports transformers itself.
    return hasattr(obj, "model_type") and hasattr(obj, "to_dict") and not isinstance(obj, type)


def empty_model(
    config_or_class: Union[Any, type, Callable[..., nn.Module]],
    *args,
    dtype: torch.dtype | None = None,
    **kwargs,
) -> nn.Module:
    """Build a model skeleton whose weights are on ``meta`` and whose computed buffers are real.

    Args:
        config_or_class: a transformers ``PretrainedConfig`` (the model is
            ``AutoModelForCausalLM.from_config(config)``, through :mod:`torch_bq.hf`,
            which needs the ``hf`` extra), or an ``nn.Module`` class / any callable
            returning a module, called as ``config_or_class(*args, **kwargs)``.
        dtype: the floating dtype of the parameters (default: the config's or
            torch's default dtype).

    Returns:
        The model in eval mode. Parameters and persistent buffers are on ``meta``
        (``load_quantized_`` fills them); non-persistent buffers (rotary
        ``inv_freq``) are computed on CPU; tied weights (``lm_head`` and the input
        embedding of Qwen3, Gemma, ...) are one tensor, which ``load_quantized_``
        fills once and keeps tied.

    Example::

        model = empty_model(AutoConfig.from_pretrained(path))
        load_quantized_(model, path)
    """
    if _is_hf_config(config_or_class):
        from .. import hf

        with meta_weights():
            model = hf.model_from_config(config_or_class, *args, dtype=dtype, **kwargs)
    else:
        if not callable(config_or_class):
            raise TypeError(
                f"config_or_class: expected a transformers config, an nn.Module class or a callable, "
                f"got {type(config_or_class).__name__}"
            )
        previous = torch.get_default_dtype()
        if dtype is not None:
            torch.set_default_dtype(dtype)
        try:
            with meta_weights():
                model = config_or_class(*args, **kwargs)
        finally:
            torch.set_default_dtype(previous)
        if not isinstance(model, nn.Module):
            raise TypeError(f"config_or_class: returned a {type(model).__name__}, not an nn.Module")
    return model.eval()
