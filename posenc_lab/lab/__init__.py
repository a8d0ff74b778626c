"""The lab: the experiment around the core, in rooms by stage (the ``[lab]`` extra; the figures need ``[figures]``).

``data`` (corpora, prose, synthetic tasks) -> ``run`` (training, units, processes, several GPUs, the run folder's
schema) -> ``measure`` (perplexity, accuracy, the far-context gain, passkeys, diagnostics, streams, the budget, the
effective length) -> ``experiments`` (the language model, retrieval, context: a spec, its presets and its run
each) -> ``verdicts`` (statistics, the article's claims, the verdicts in words, the tables) -> ``figures``.
``results`` reads the committed runs, ``readme`` writes the README's generated blocks from them. The lab imports
the core; the core never imports the lab.
"""
