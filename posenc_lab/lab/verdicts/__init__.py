"""From tables to verdicts: seeds as samples (``statistics``), the article's claims as tests (``claims``), the
verdicts for a reader (``in_words``) and the results table summarised with its report (``tables``)."""
