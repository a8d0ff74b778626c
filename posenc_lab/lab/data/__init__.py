"""What the models read: byte corpora (``corpora``), the English prose corpus (``prose``) and the synthetic
retrieval tasks (``tasks``)."""
