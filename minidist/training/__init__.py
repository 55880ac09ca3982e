"""Running a training job (chapters 1 and 9): what sits between the demo's flags and the strategies.

    train.py       the serial step every strategy reproduces (SerialTrainer, MoETrainer) and the
                   trainer protocol and state helpers the parallel trainers share
    layout.py      a layout as a value (Layout: dp, tp, pp, cp, ep, ZeRO, ...) and its one rule
    strategies.py  build_trainer(layout): the trainer class a layout needs
    checkpoint.py  saving and loading a job's state, crash-safe (chapter 9)
    reshard.py     any layout's checkpoint read by any other layout
"""
