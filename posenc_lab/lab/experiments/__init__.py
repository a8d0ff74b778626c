"""The three experiments, each a spec, its named presets and its run over the one unit runner: the language model
(``language_model``, and ``extend_run`` for evaluations added to a finished run), passkey retrieval
(``retrieval``) and the use of far context (``context``); ``recipe`` holds the model's shape and the training
recipe they share."""
