"""posenc-lab: Transformer position encodings, derived, tested and compared at lengths past training.

The core needs torch and einops only. Its public names:

* the registry: ``ENCODINGS`` (name -> class) and ``make_encoding(name, head_dim=..., num_heads=..., train_len=...)``;
* Hugging Face's RoPE types by name: ``rope_from_hf(config.rope_parameters, head_dim, max_position_embeddings=...)``
  builds the ``RoPE`` of a config's RoPE dict (``default``, ``linear``, ``dynamic``, ``yarn``, ``longrope``,
  ``llama3``: ``HF_ROPE_TYPES``), with transformers' frequencies and attention factor;
* the encodings: ``NoPE``, ``Sinusoidal``, ``SinusoidalSmall``, ``Learned``, ``RoPE``, ``PartialRoPE``, ``PRoPE``,
  ``RoPEBase500``, ``RoPEBase500k``, ``RoPENoPELayers``, ``RandomizedRoPE``, ``RandomizedLearned``, ``XPos``,
  ``ALiBi``, ``T5``, ``Kerple``, ``Fire``, ``FoPE``, ``SSMax``, ``SSMaxRoPE`` (each an ``Encoding`` with the hooks
  ``embed``, ``rotate``, ``bias``), two that read the tokens: ``FoX`` (forget gates on the layer's input, the
  ``decay`` hook) and ``CoPE`` (contextual positions from the queries and keys, the ``token_bias`` hook), DAPE on a
  base bias (``DAPEALiBi``, ``DAPEKerple``, ``DAPEFire``: a network of the logits and the bias, ``token_bias``), the
  local/global layer mixes ``Gemma3Layers``, ``IRoPE``, ``RNoPESWA`` with Llama 4's ``NoPETemperature``, ``PaTH``
  (Householder-like transforms of the layer's input, accumulated between key and query: the ``householder`` hook;
  ``PaTHFoX`` with FoX's gates too)
  and ``StickBreaking`` (stick-breaking weights in place of the softmax, no position signal: ``weighting``);
* attention: ``attention(q, k, v, encoding)`` over the ``BACKENDS``, grouped-query and a padding mask (``real_keys``)
  included; ``KVCache`` and ``SinkCache`` for decoding; ``bias_tensor(encoding, positions)``, the ``h n n`` bias to add to your own scores;
* RoPE as functions: ``apply_rope``, ``inv_freq``, ``scaled_inv_freq`` and its registry ``ROPE_SCALINGS`` (``pi``,
  ``ntk``, ``dynamic-ntk``, ``yarn``, ``llama3``, ``longrope``), ``yarn_attention_factor``, ``ntk_base``;
* the modules ``rope``, ``bias`` and ``absolute`` with every formula as a pure function, and the errors
  ``PosencError`` and ``PositionOutOfRange``.

The experiment lives in ``posenc_lab.lab``, one folder per stage (``data``, ``run``, ``measure``, ``experiments``,
``verdicts``, ``figures``); it needs the ``[lab]`` extra, its figures the ``[figures]`` extra. The core never imports it.
"""

from . import absolute, bias, rope
from .backends import BACKENDS, KVCache, SinkCache, attention, bias_tensor, repeat_kv
from .encodings import (ENCODINGS, HF_ROPE_TYPES, ALiBi, CoPE, DAPEALiBi, DAPEFire, DAPEKerple,
                        Encoding, Fire, FoPE, FoX, Gemma3Layers, IRoPE, Kerple,
                        Learned, NoPE, NoPETemperature, PartialRoPE, PaTH, PaTHFoX,
                        PRoPE, RandomizedLearned, RandomizedRoPE,
                        RNoPESWA, RoPE, RoPEBase500, RoPEBase500k, RoPENoPELayers, Sinusoidal, SinusoidalSmall, SSMax,
                        SSMaxRoPE, StickBreaking, T5, XPos, make_encoding, rope_from_hf)
from .errors import PosencError, PositionOutOfRange, TrainingDiverged
from .rope import ROPE_SCALINGS, apply_rope, inv_freq, ntk_base, scaled_inv_freq, yarn_attention_factor

__version__ = "0.1.0"

__all__ = [
    "ALiBi", "BACKENDS", "CoPE", "DAPEALiBi", "DAPEFire", "DAPEKerple",
    "ENCODINGS", "Encoding", "Fire", "FoPE", "FoX", "Gemma3Layers", "HF_ROPE_TYPES", "IRoPE",
    "KVCache", "Kerple", "Learned", "NoPE", "NoPETemperature", "PRoPE", "PaTH", "PaTHFoX", "PartialRoPE", "PosencError",
    "PositionOutOfRange",
    "RNoPESWA", "ROPE_SCALINGS", "RandomizedLearned", "RandomizedRoPE", "RoPE", "RoPEBase500", "RoPEBase500k",
    "RoPENoPELayers", "SSMax", "SSMaxRoPE", "Sinusoidal", "SinusoidalSmall", "SinkCache", "StickBreaking", "T5",
    "TrainingDiverged",
    "XPos", "absolute", "apply_rope", "attention", "bias", "bias_tensor", "inv_freq", "make_encoding", "ntk_base",
    "repeat_kv", "rope", "rope_from_hf", "scaled_inv_freq", "yarn_attention_factor",
]
