"""What a transformers model's config says about its attention, read as transformers applies it."""

from __future__ import annotations


def text_config(model):
    """The config of the model's text decoder (``get_text_config()`` of a multimodal config), or None."""
    cfg = getattr(model, "config", None)
    return cfg.get_text_config() if cfg is not None and hasattr(cfg, "get_text_config") else cfg


def model_sliding_window(model) -> int | None:
    """The sliding window (tokens) of the model's attention, or None when every layer attends to all tokens; read as
    transformers does: ``layer_types`` where present, else ``sliding_window`` (under ``use_sliding_window`` if any)."""
    cfg = text_config(model)
    window = getattr(cfg, "sliding_window", None)
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return None
    layer_types = getattr(cfg, "layer_types", None)
    slides = "sliding_attention" in layer_types if layer_types else getattr(cfg, "use_sliding_window", True)
    return window if slides else None


def model_may_slide(model) -> bool:
    """:func:`model_sliding_window`, or a config that switches sliding windows on (``use_sliding_window``) even
    where no layer applies one: the stricter reading of the components that never take such a model."""
    return bool(getattr(text_config(model), "use_sliding_window", False)) or model_sliding_window(model) is not None
