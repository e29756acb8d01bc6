"""Experiment and report tooling, apart from the library: the only place that needs matplotlib.

    comparison  ``async-vapo experiment``: run / report VAPO against its baselines and the ablation table
    report      ``async-vapo report``: benchmark result folders -> PNG plots and markdown tables
    plots       the figures (``async-vapo plot``: held-out accuracy and length curves of runs)
"""
