"""Flax NNX decoder models. Every dense family is `Decoder` with its own config."""

from jaxinfer.models.decoder import Decoder

__all__ = ["Decoder"]
