"""minidist.lab: helpers for the notebooks and benchmarks.

Not part of any strategy: rank programs that a notebook starts on N real MPI ranks (functions
the ranks import by name must live in a module), and props for experiments, such as a rank
made slow on purpose. The strategies in `minidist/parallel/` never import from here.

    stragglers.py     a model made slower by busy work per row: a straggler (chapter 3, section 7)
    dp_variants.py    data-parallel runs for notebook 03 that report what they measured (chapter 3)
    gemms_in_step.py  the Linear layers' GEMMs timed inside a training step and alone (chapter 1)
"""
