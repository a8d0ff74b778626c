"""Measuring a trained model: perplexity at any length (``perplexity``, and every length and mode of a spec in
``perplexity_grid``), exact-match accuracy (``accuracy``), the gain from far context (``far_context``), a passkey in
the text (``passkey``), attention diagnostics (``diagnostics``), streams through a rolling cache (``streaming``),
the budget along training (``budget``) and the effective context length (``effective_length``)."""
