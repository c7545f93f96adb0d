"""Flax NNX decoder models: every family, dense and MoE, is one `Decoder` with its own config
(`decoder.py`; its layers in `layers.py`, the MoE block in `moe.py`). A model runs in the
one form those classes define; `inference_form.py` builds it from checkpoint tensors."""

from jaxinfer.models.decoder import Decoder

__all__ = ["Decoder"]
