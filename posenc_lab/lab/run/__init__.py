"""Running units: training (``training``), units run and recorded one by one (``units``), units in parallel
processes (``processes``), several GPUs (``distributed``), and the run folder's schema (``schema``)."""
