"""The model, mesh-free: the layers (pure math on arrays), the loss, the Transformer LM (Flax NNX)
and the hooks seam (`hooks.Parallelism`) where a strategy acts on it."""

from twinshard.model.state_dict import load_state_dict, state_dict
from twinshard.model.transformer import ACTIVATION, LOGITS, TransformerLM, scan_layers, scan_stacked

__all__ = ["ACTIVATION", "LOGITS", "TransformerLM", "load_state_dict", "scan_layers", "scan_stacked", "state_dict"]
