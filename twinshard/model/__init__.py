"""The model, mesh-free: the layers (pure math on arrays), the loss, the Transformer LM (Flax NNX)
and the hooks seam (`hooks.Parallelism`) where a strategy acts on it."""

from twinshard.model.transformer import (ACTIVATION, LOGITS, TransformerLM, load_state_dict,
                                         scan_layers, scan_stacked, state_dict)

__all__ = ["ACTIVATION", "LOGITS", "TransformerLM", "load_state_dict", "scan_layers", "scan_stacked", "state_dict"]
